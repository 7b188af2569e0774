"""The first thing a cloud node runs: a shell script that installs tfsn, runs its agent, then powers off.

Every VM driver (AWS user-data, GCP startup-script metadata, Azure custom data) passes the same
script, so what a node does at boot is written once. The script is idempotent: a VM that reboots
runs it again and ends in the same state.
"""
from __future__ import annotations

import shlex

from providers.base import NodeRequest

# What `pip install` gets on the node; a site with a wheel mirror sets TFSN_INSTALL_SPEC in the job's envs.
INSTALL_SPEC_ENV = "TFSN_INSTALL_SPEC"
DEFAULT_INSTALL_SPEC = "tfsn"


def install_command(spec: str | None = None, *, default: str = DEFAULT_INSTALL_SPEC) -> str:
    """The shell command that pip installs tfsn unless the image has it already, so that every node, pod and
    the operator start the same way: `spec` is the requirement to install; None leaves the choice to the
    node's shell, $TFSN_INSTALL_SPEC there, else `default`."""
    requirement = shlex.quote(spec) if spec is not None else f'"${{{INSTALL_SPEC_ENV}:-{default}}}"'
    return f"command -v tfsn >/dev/null 2>&1 || python3 -m pip install --quiet {requirement}"


def requested_install_spec(request: NodeRequest) -> str:
    """What a node installs as tfsn: the job's TFSN_INSTALL_SPEC, else the released package."""
    return request.env.get(INSTALL_SPEC_ENV, DEFAULT_INSTALL_SPEC)


def startup_script(request: NodeRequest) -> str:
    """A bash script that exports the request's environment, installs tfsn and runs its command."""
    exports = "\n".join(f"export {name}={shlex.quote(value)}" for name, value in sorted(request.env.items())
                        if name.isidentifier())
    command = " ".join(shlex.quote(part) for part in request.command)
    workdir = shlex.quote(request.workdir)
    return f"""#!/bin/bash
# tfsn node {request.node_id} of job {request.job_id}
set -euo pipefail
exec >>/var/log/tfsn-node.log 2>&1
{exports}
mkdir -p {workdir}
cd {workdir}
{install_command(requested_install_spec(request))}
{command} || true
# The agent exits when the job is over or its controller is gone for good: the machine goes too (AWS
# terminates on shutdown; a GCP or Azure VM stops, and the controller deletes it when it can).
shutdown -h now
"""
