"""`tfsn operator`: print the Kubernetes manifests of the operator, or run it (kopf).

Kept apart from the operator itself so that `tfsn` starts without kopf or the kubernetes client:
both are imported inside the commands.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Optional

import typer

operator_app = typer.Typer(no_args_is_help=True, help="The Kubernetes operator: TfsnJob resources run by tfsn.")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _fail(message: str) -> None:
    typer.echo(f"tfsn: error: {message}", err=True)
    raise typer.Exit(2)


def _check_name(option: str, value: str) -> None:
    if value and not _DNS_LABEL.fullmatch(value):
        _fail(f"{option} {value!r} is not a valid Kubernetes name. To fix: use lower-case letters, digits and '-', "
              "at most 63, starting and ending with a letter or digit")


@operator_app.command()
def manifests(namespace: str = typer.Option("tfsn-system", help="Namespace the operator runs in."),
              image: Optional[str] = typer.Option(None, help="The operator's image (tfsn installed)."),
              checkpoint_claim: str = typer.Option("", help="Default PersistentVolumeClaim of checkpoints, in each "
                                                   "job's namespace (a TfsnJob may name its own)."),
              watch_namespace: str = typer.Option("", help="Run the TfsnJobs of this namespace only: the operator's "
                                                  "rights on pods, Services and Secrets are a Role there, not "
                                                  "cluster-wide.")) -> None:
    """Print the CRD, least-privilege RBAC and the operator Deployment, for `kubectl apply -f -`."""
    import yaml

    from orchestrator.k8s import crd

    _check_name("--namespace", namespace)
    _check_name("--checkpoint-claim", checkpoint_claim)
    _check_name("--watch-namespace", watch_namespace)
    docs = crd.manifests(namespace, image or crd.DEFAULT_IMAGE, checkpoint_claim, watch_namespace)
    typer.echo(yaml.safe_dump_all(docs, sort_keys=False).rstrip())


@operator_app.command()
def run(namespace: Optional[str] = typer.Option(None, envvar="TFSN_OPERATOR_NAMESPACE",
                                                help="Watch TfsnJobs of this namespace only (default: all)."),
        port: int = typer.Option(8080, help="Port of the API that worker pods' agents report to."),
        advertise: str = typer.Option("", help="Host name the pods reach that API at (the operator's Service)."),
        checkpoint_claim: str = typer.Option("", help="Default PersistentVolumeClaim of checkpoints."),
        verbose: bool = typer.Option(False, "--verbose", help="Log every handler run.")) -> None:
    """Run the operator in this process until interrupted (kopf)."""
    _check_name("--namespace", namespace or "")
    _check_name("--checkpoint-claim", checkpoint_claim)
    if not 0 <= port < 65536:
        _fail(f"--port {port} is not a TCP port. To fix: use 1-65535, or 0 for any free port")
    try:
        import kopf
    except ImportError as err:
        _fail(f"the operator needs kopf ({err}). To fix: pip install 'tfsn[k8s]'")
    # The handlers read their settings from the environment (kopf builds the operator, not us).
    for key, value in (("TFSN_OPERATOR_PORT", str(port)), ("TFSN_OPERATOR_ADVERTISE", advertise),
                       ("TFSN_OPERATOR_CHECKPOINT_CLAIM", checkpoint_claim),
                       ("TFSN_OPERATOR_NAMESPACE", namespace or "")):
        if value:
            os.environ[key] = value
    import orchestrator.k8s.operator  # noqa: F401  (registers the handlers)
    from orchestrator.k8s.crd import LIVENESS_PORT

    kopf.configure(verbose=verbose)
    kopf.run(standalone=True, clusterwide=namespace is None, namespaces=[namespace] if namespace else (),
             liveness_endpoint=f"http://0.0.0.0:{LIVENESS_PORT}/healthz")
    sys.exit(0)
