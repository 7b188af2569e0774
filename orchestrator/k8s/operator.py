"""The Kubernetes operator's kopf handlers: one per event, each a few lines around `Operator`
(orchestrator.k8s.runtime), which runs the controller for every TfsnJob.

- startup: start the operator (the controller's loop, its API server, the status writer) and adopt the
  TfsnJobs under way (orchestrator.k8s.adoption): re-create their controller jobs from `.status`, and
  only then restart those that cannot be carried on. A listing that fails fails this handler, which
  kopf runs again;
- create: admit the TfsnJob (a bad spec gets a status condition, and no pods);
- resume: adoption of a TfsnJob the startup listing missed;
- timer: taint what a refused taint left, have the writer check `.status`, keep the conditions, and
  post a NodeTainted event for every host tainted since (orchestrator.k8s.taints);
- update of the spec: not applied to a job under way; a condition says so and how to apply it;
- delete: stop the job; the controller deletes the pods, owner references the Secret and Service.

A refusal of the API server (a 503, a timeout, RBAC) becomes `kopf.TemporaryError`: kopf runs the
handler again after RETRY_DELAY_S.

Adoption lists the TfsnJobs of the namespaces the operator watches, and kopf does not tell its startup
handler which those are, only whether it watches the whole cluster. So: TFSN_OPERATOR_NAMESPACE, when
set, is the namespace listed (`tfsn operator run --namespace X` sets it and has kopf watch X alone);
otherwise the whole cluster is listed, but only when kopf runs cluster-wide. An operator started with
`kopf run --namespace X` and no TFSN_OPERATOR_NAMESPACE refuses to start (it would adopt the jobs of
namespaces another operator runs) and says to set it.

Run it with `tfsn operator run` (or `kopf run -m orchestrator.k8s.operator --all-namespaces`); settings
come from TFSN_OPERATOR_* variables (see `OperatorSettings`).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

import kopf

from orchestrator.k8s.crd import GROUP, KIND, PLURAL, VERSION
from orchestrator.k8s.runtime import Operator, OperatorSettings
from providers.base import ProviderError
from providers.kubernetes import UNHEALTHY_TAINT

SYNC_S = float(os.environ.get("TFSN_OPERATOR_SYNC_S", 3))  # how often the timer checks .status
RETRY_DELAY_S = 10.0            # when kopf runs a handler again after the API server refused it something

RESOURCE = (GROUP, VERSION, PLURAL)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The pod's service account in the cluster, else the kubeconfig, read now (KUBECONFIG set by then)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _retried(handler: Callable[[dict[str, Any]], dict[str, Any]], body: kopf.Body) -> dict[str, Any]:
    """A handler's work, a refusal of the API server (a 503, a timeout, RBAC) made a retry after a delay."""
    try:
        return handler(dict(body))
    except ProviderError as err:
        raise kopf.TemporaryError(f"{err} (tried again in {RETRY_DELAY_S:.0f}s)", delay=RETRY_DELAY_S) from None


def adoption_namespace(clusterwide: bool, namespace: str) -> str:
    """The namespace whose TfsnJobs are adopted at start ("": all); see the module docstring."""
    if namespace or clusterwide:
        return namespace
    raise kopf.PermanentError(
        f"kopf watches some namespaces only, and TFSN_OPERATOR_NAMESPACE does not say which: the operator would "
        f"adopt the {KIND}s of every namespace. To fix: set TFSN_OPERATOR_NAMESPACE to the watched namespace, or "
        "run `tfsn operator run --namespace NAME`")


@kopf.on.startup()
def start(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = logging.WARNING   # Kubernetes events for problems, not for every handler run
    operator = getattr(memo, "tfsn", None)
    try:
        if operator is None:     # not again when kopf retries this handler: one operator, one port for its API
            ours = OperatorSettings.from_env()
            adoption_namespace(settings.peering.clusterwide, ours.namespace)
            operator = memo.tfsn = Operator(ours)     # reads (or keeps) its CA's Secret
        operator.start()
        operator.adoption.adopt_all()
    except ProviderError as err:   # kopf runs no other handler before this one succeeds: none admits a job
        raise kopf.TemporaryError(f"{err} (tried again in {RETRY_DELAY_S:.0f}s)", delay=RETRY_DELAY_S) from None


@kopf.on.cleanup()
def stop(memo: kopf.Memo, **_: Any) -> None:
    operator = getattr(memo, "tfsn", None)
    if operator is not None:
        operator.close()


@kopf.on.create(*RESOURCE)
def create(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    patch.status.update(_retried(memo.tfsn.admit, body))


@kopf.on.resume(*RESOURCE)
def resume(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    patch.status.update(_retried(memo.tfsn.adoption.adopt, body))


@kopf.timer(*RESOURCE, interval=SYNC_S)
def sync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    patch.status.update(memo.tfsn.sync(dict(body)))
    for host, failure in memo.tfsn.tainted_since(dict(body)):
        kopf.warn(body, reason="NodeTainted", message=f"{UNHEALTHY_TAINT} on {host}: {failure}")


@kopf.on.update(*RESOURCE, field="spec")
def update(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    patch.status.update(_retried(memo.tfsn.spec_changed, body))   # a refused spec edited is admitted: Secret, Service


@kopf.on.delete(*RESOURCE)
def delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    if not memo.tfsn.release(dict(body)):
        raise kopf.TemporaryError("stopping the job's pods", delay=2)
