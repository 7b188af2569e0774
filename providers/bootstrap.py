"""The first thing a cloud VM runs: a bash script that installs tfsn, fetches the job's code, runs the agent,
and powers the machine off, whatever happened.

Every VM driver (AWS user-data, GCP startup-script metadata, Azure custom data) passes the same script, so
what a node does at boot is written once. In order:

1. everything it writes goes under the node's root folder (`BootFiles.root`, or `$TFSN_NODE_ROOT` where the
   machine sets it): `boot.log` (all of its output and the agent's), the downloads, and the job's workdir;
2. tfsn's wheel is downloaded from the controller's API with the node's own token (TLS pinned to the
   controller's CA), checked against its sha256, and pip installed: exactly that file, plus the
   dependencies it declares from the package index, with the extra that holds the driver of the job's
   checkpoint store (`tfsn[aws]` for s3://: s3fs in the wheel's pinned range); `TFSN_INSTALL_SPEC`, where
   set, is installed instead; the driver must then import, or the boot fails saying so;
3. the job's code archive is downloaded and checked the same way, and unpacked into the workdir;
4. the agent runs in the workdir until the job no longer needs the node.

A trap on EXIT runs on any outcome (`set -e` makes every failed step an exit): a failure ships the last
TAIL_BYTES of the boot log to the controller (`tfsn status JOB` shows it), and the machine powers off in
every case (AWS terminates on shutdown; a GCP or Azure VM stops, and the controller deletes it). Every
network call has a deadline and bounded retries, so an unreachable controller ends in a power-off too.

The script needs bash, curl, tar, sha256sum and python3 with pip (every Deep Learning image has them), and
root only to power off. It is idempotent: a VM that reboots runs it again, and a download already there with
the right sha256 is not fetched again.
"""
from __future__ import annotations

import os
import shlex

from providers.base import NodeRequest

# What `pip install` gets on the node instead of the controller's wheel, for users who publish their own tfsn.
INSTALL_SPEC_ENV = "TFSN_INSTALL_SPEC"
TAIL_BYTES = 16 * 1024              # of the boot log sent to the controller on a failure
ARTIFACTS_ROUTE = "artifacts"       # the node's API routes under /v1/jobs/JOB/nodes/NODE/ (orchestrator's api.py)
BOOT_FAILURE_ROUTE = "boot-failure"

# The script's fixed part: helpers and the trap. Settings a machine may give it in its environment (a test
# harness playing the VM does): TFSN_BOOT_RETRIES, TFSN_BOOT_RETRY_DELAY_S, TFSN_BOOT_DOWNLOAD_S.
_HELPERS = r"""
tfsn_api() {  # the node's routes on the controller
  printf '%s/v1/jobs/%s/nodes/%s' "$TFSN_CONTROLLER_URL" "$TFSN_JOB_ID" "$TFSN_NODE_ID"
}

tfsn_curl() {  # a call with a deadline, bounded retries, the node's token, and only the controller's CA trusted
  local tls=()
  if [ -n "${TFSN_CA_PEM:-}" ]; then
    printf '%s\n' "$TFSN_CA_PEM" >"$TFSN_NODE_ROOT/controller-ca.pem"
    tls=(--cacert "$TFSN_NODE_ROOT/controller-ca.pem")
  fi
  curl --silent --show-error --fail --connect-timeout 10 --retry "${TFSN_BOOT_RETRIES:-4}" \
    --retry-delay "${TFSN_BOOT_RETRY_DELAY_S:-2}" --retry-max-time 120 --retry-connrefused ${tls[@]+"${tls[@]}"} \
    -H "Authorization: Bearer $TFSN_TOKEN" "$@"
}

tfsn_fetch() {  # tfsn_fetch SHA256 FILE: the controller's artifact SHA256 into FILE, unless FILE already is it
  if [ -f "$2" ] && [ "$(sha256sum "$2" | cut -d' ' -f1)" = "$1" ]; then
    return 0
  fi
  tfsn_curl --max-time "${TFSN_BOOT_DOWNLOAD_S:-900}" --output "$2.part" "$(tfsn_api)/__ARTIFACTS__/$1"
  local got
  got=$(sha256sum "$2.part" | cut -d' ' -f1)
  if [ "$got" != "$1" ]; then
    echo "[tfsn] $2 from the controller has sha256 $got, not $1"
    return 1
  fi
  mv "$2.part" "$2"
}

tfsn_report() {  # tfsn_report CODE: the end of the boot log, as JSON, to the controller
  local body="$TFSN_NODE_ROOT/boot-failure.json"
  {
    printf '{"stage": "%s", "returncode": %d, "tail": "' "$tfsn_stage" "$1"
    tail -c __TAIL__ "$TFSN_NODE_ROOT/boot.log" | LC_ALL=C tr '\11' ' ' | LC_ALL=C tr -c '\12\40-\176' '?' |
      sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/$/\\n/' | tr -d '\n'
    printf '"}'
  } >"$body"
  tfsn_curl --max-time 20 -H 'Content-Type: application/json' --data-binary "@$body" \
    --output /dev/null "$(tfsn_api)/__BOOT_FAILURE__"
}

tfsn_finish() {  # on every exit: a failure is reported if the controller can be reached; the machine goes
  local code=$?
  trap - EXIT
  set +eu
  if [ "$code" -ne 0 ]; then
    echo "[tfsn] boot failed in stage '$tfsn_stage' with exit code $code; powering off"
    tfsn_report "$code" || echo "[tfsn] the controller could not be told"
  fi
  shutdown -h now
}
""".replace("__ARTIFACTS__", ARTIFACTS_ROUTE).replace("__BOOT_FAILURE__", BOOT_FAILURE_ROUTE).replace(
    "__TAIL__", str(TAIL_BYTES))

_PIP = "python3 -m pip install --quiet --disable-pip-version-check"


def install_command(spec: str | None = None, *, default: str | None = None) -> str:
    """For nodes that start from an image (Kubernetes pods, SkyPilot clusters): the image's tfsn if it has one,
    else pip install `spec` (None: $TFSN_INSTALL_SPEC in the node's shell, else `default`); with neither, a
    clear error and a non-zero exit, never a bare name from a package index that anyone could register."""
    requirement = shlex.quote(spec) if spec is not None else f'"${{{INSTALL_SPEC_ENV}:-{default or ""}}}"'
    missing = (f'echo "tfsn: this image has no tfsn. To fix: use an image with tfsn installed, or set '
               f'{INSTALL_SPEC_ENV} to a tfsn pip can install" >&2; exit 1')
    return (f"command -v tfsn >/dev/null 2>&1 || {{ [ -n {requirement} ] && {_PIP} {requirement}; }} "
            f"|| {{ {missing}; }}")


def install_steps(request: NodeRequest) -> str:
    """The lines that put tfsn on the node: the controller's wheel, checked, with its declared dependencies
    (installed alone first, so that an image's own tfsn of the same version is replaced) and the job's extra
    (its pinned ranges are the wheel's own, pyproject's); else the user's TFSN_INSTALL_SPEC; else nothing (the
    image must hold tfsn, and the agent's start says so if not). Then the extra's module must import."""
    boot = request.boot
    if boot is not None and boot.wheel:
        wheel = f'"$TFSN_NODE_ROOT"/{shlex.quote(boot.wheel)}'
        steps = f"tfsn_fetch {boot.wheel_sha256} {wheel}\n{_PIP} --no-deps --force-reinstall {wheel}\n"
        if boot.extra:
            steps += _or_fail(f"{_PIP} {wheel}{shlex.quote(f'[{boot.extra}]')}", (
                f"cannot install tfsn[{boot.extra}]'s dependencies ({boot.extra_module} is the driver of the job's "
                f"checkpoint.dir): pip said why above. To fix: let the VM's pip reach an index that has them, or "
                f"boot an image with them installed"))
        else:
            steps += f"{_PIP} {wheel}\n"
    elif INSTALL_SPEC_ENV in request.env:
        steps = f'{_PIP} "${INSTALL_SPEC_ENV}"\n'
    else:
        steps = ""
    if boot is not None and boot.extra_module:
        steps += _or_fail(f"python3 -c {shlex.quote(f'import {boot.extra_module}')}", (
            f"{boot.extra_module} (the driver of the job's checkpoint.dir) does not import on the node. To fix: "
            f"install tfsn[{boot.extra}] there ({INSTALL_SPEC_ENV} naming the extra, where it is set), or boot an "
            f"image with {boot.extra_module} installed"))
    return steps


def _or_fail(command: str, why: str) -> str:
    """A line that runs `command` and, if it fails, ends the boot with `why` as the boot log's last line."""
    return f"{command} || {{ echo {shlex.quote(f'[tfsn] {why}')}; exit 1; }}\n"


def code_steps(request: NodeRequest) -> str:
    """The lines that unpack the job's code archive into the workdir (none where there is no archive)."""
    if request.boot is None or not request.boot.code_sha256:
        return ""
    archive = f'"$TFSN_NODE_ROOT"/code-{request.boot.code_sha256}.tar.gz'
    return (f"tfsn_fetch {request.boot.code_sha256} {archive}\n"
            f'tar -xzf {archive} -C "$TFSN_WORKDIR" --no-same-owner\n')


def node_workdir(request: NodeRequest) -> str:
    """The workdir as a shell word: an absolute one as it is, a relative one under the node's root."""
    if os.path.isabs(request.workdir):
        return shlex.quote(request.workdir)
    return f'"$TFSN_NODE_ROOT"/{shlex.quote(request.workdir)}'


def startup_script(request: NodeRequest) -> str:
    """The boot script of `request`'s node (see the module docstring)."""
    exports = "\n".join(f"export {name}={shlex.quote(value)}" for name, value in sorted(request.env.items())
                        if name.isidentifier())
    command = " ".join(shlex.quote(part) for part in request.command)
    root = request.boot.root if request.boot is not None else "/var/lib/tfsn"
    return f"""#!/bin/bash
# tfsn node {request.node_id} of job {request.job_id}: installs tfsn, fetches the job's code, runs the agent,
# and powers the machine off on any outcome. It writes under $TFSN_NODE_ROOT only (default {root}).
set -euo pipefail
umask 077
{_HELPERS}
trap tfsn_finish EXIT
tfsn_stage=start
export TFSN_NODE_ROOT="${{TFSN_NODE_ROOT:-{shlex.quote(root)}}}"
mkdir -p "$TFSN_NODE_ROOT"
exec >>"$TFSN_NODE_ROOT/boot.log" 2>&1
echo "[tfsn] node {request.node_id} boots ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
{exports}
export TFSN_WORKDIR={node_workdir(request)}
mkdir -p "$TFSN_WORKDIR"
tfsn_stage=install
{install_steps(request)}tfsn_stage=code
{code_steps(request)}tfsn_stage=agent
cd "$TFSN_WORKDIR"
{command}
"""
