"""The operator end to end: kopf's own test runner runs `orchestrator.k8s.operator` against kmock's emulator.

A TfsnJob created through the kubernetes client gets its pods and status from the running operator
(kopf's watch, handlers, finalizer and status patches; the controller's loop in its thread); deleting
it stops the job, deletes the pods and lets the TfsnJob go.
"""
from __future__ import annotations

import time

import pytest

pytest.importorskip("kubernetes")
kmock = pytest.importorskip("kmock")
pytest.importorskip("kopf")

from kopf.testing import KopfRunner  # noqa: E402

from orchestrator.k8s import crd  # noqa: E402
from providers.kubernetes import GPU  # noqa: E402
from tests import test_operator as operator_tests  # noqa: E402
from tests.test_provider_kubernetes import NAMESPACE, PODS, running_cluster  # noqa: E402

TFSNJOBS = kmock.resource(crd.GROUP, crd.VERSION, crd.PLURAL)
WAIT_S = 30.0       # generous: the machine may be loaded; every wait ends as soon as its condition holds


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    yield from running_cluster(tmp_path, monkeypatch)



def wait_for(what: str, check):
    return operator_tests.wait_for(what, check, timeout_s=WAIT_S, poll_s=0.2)


class Lab:
    """The emulator as a cluster with a GPU node and the TfsnJob resource, the operator's settings in the
    environment, and the kubernetes client's CustomObjectsApi on it."""

    def __init__(self, cluster, tmp_path, monkeypatch) -> None:
        import os

        import kubernetes

        self.cluster = cluster
        cluster.add_node("gpu-a", {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, {GPU: "8", "cpu": "96"})
        # What a real API server's discovery shows: kopf waits for namespaces there before it watches anything.
        cluster.on_loop(lambda k: k.resources.__setitem__(TFSNJOBS, kmock.ResourceInfo(
            kind=crd.KIND, singular="tfsnjob", namespaced=True, subresources={"status"},
            verbs={"get", "list", "watch", "create", "patch", "update", "delete"})))
        cluster.on_loop(lambda k: k.resources.__setitem__(kmock.resource("", "v1", "namespaces"), kmock.ResourceInfo(
            kind="Namespace", singular="namespace", namespaced=False, verbs={"get", "list", "watch"})))
        monkeypatch.setenv("TFSN_HOME", str(tmp_path / "operator"))
        monkeypatch.setenv("TFSN_OPERATOR_HOST", "127.0.0.1")
        monkeypatch.setenv("TFSN_OPERATOR_ADVERTISE", "tfsn-operator.test")   # the agents are not run here
        monkeypatch.setenv("TFSN_OPERATOR_POD_POLL_S", "0.5")
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(os.environ["KUBECONFIG"], client_configuration=configuration)
        self.api = kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(configuration))

    def create(self) -> None:
        self.api.create_namespaced_custom_object(crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, {
            "apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND,
            # kmock keeps what it is given: the uid and resourceVersion a real API server would assign
            "metadata": {"name": "e2e", "namespace": NAMESPACE, "uid": "6f1c7a52-0d54-4f3a-9a8e-2b1f1d2c3e4f",
                         "resourceVersion": "1"},
            "spec": {"run": "python train.py", "resources": {"accelerators": "H100:8"}}}, _request_timeout=10)

    def delete(self) -> None:
        self.api.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, "e2e",
                                                 _request_timeout=10)

    def job(self) -> dict | None:
        return self.cluster.on_loop(lambda k: None if (TFSNJOBS, NAMESPACE, "e2e") not in k.objects
                                    or k.objects[TFSNJOBS, NAMESPACE, "e2e"].deleted
                                    else dict(k.objects[TFSNJOBS, NAMESPACE, "e2e"].raw))

    def pods(self, ever: bool = False) -> list[str]:
        return self.cluster.on_loop(lambda k: [name for (res, ns, name), obj in k.objects.items()
                                               if res == PODS and (ever or not obj.deleted)])

    def mirrored(self) -> dict:
        return wait_for("the status mirrored", lambda: (self.job() or {}).get("status", {}).get("nodes")
                        and self.job()["status"])


ARGS = ["run", "--standalone", "--all-namespaces", "-m", "orchestrator.k8s.operator"]


def test_the_operator_runs_a_tfsnjob_and_cleans_up_after_its_deletion(cluster, tmp_path, monkeypatch):
    lab = Lab(cluster, tmp_path, monkeypatch)
    with KopfRunner(ARGS, timeout=60) as runner:
        lab.create()
        [pod] = wait_for("the worker pod", lab.pods)
        # recorded (REQUESTED) before its pod was asked for, then STARTING with it
        status = wait_for("the pod's node recorded", lambda: lab.mirrored()["nodes"][0]["pod"] and lab.mirrored())
        assert (status["phase"], status["jobId"], status["nodes"][0]["pod"]) == ("Provisioning", 1, pod)
        assert "kopf.zalando.org/KopfFinalizerMarker" in lab.job()["metadata"]["finalizers"]
        lab.delete()
        wait_for("the TfsnJob to go", lambda: lab.job() is None)
        assert lab.pods() == []
    assert runner.exit_code == 0 and runner.exception is None


def test_an_operator_restarted_with_an_empty_home_carries_the_tfsnjob_on_with_its_pod(cluster, tmp_path,
                                                                                        monkeypatch):
    lab = Lab(cluster, tmp_path, monkeypatch)
    with KopfRunner(ARGS, timeout=60) as first:
        lab.create()
        [pod] = wait_for("the worker pod", lab.pods)
        wait_for("the pod's node recorded", lambda: lab.mirrored()["nodes"][0]["state"] == "STARTING")
    assert first.exit_code == 0 and first.exception is None
    before = lab.job()["status"]
    monkeypatch.setenv("TFSN_HOME", str(tmp_path / "replaced-operator"))   # the old pod's emptyDir is gone
    with KopfRunner(ARGS, timeout=60) as second:
        wait_for("the new operator's timer", lambda: lab.job()["status"].get("conditions", []) and any(
            c["type"] == "Running" for c in lab.job()["status"]["conditions"]))
        status = lab.job()["status"]
        assert (status["jobId"], status["phase"], status["nodes"]) == (before["jobId"], "Provisioning", before["nodes"])
        assert lab.pods() == [pod]
        lab.delete()      # only an operator that adopted the job can stop it and delete its pod
        wait_for("the TfsnJob to go", lambda: lab.job() is None)
        assert lab.pods() == [] and lab.pods(ever=True) == [pod]   # never recreated
    assert second.exit_code == 0 and second.exception is None


def test_a_failed_pod_taints_its_node_and_kopf_posts_one_node_tainted_event(cluster, tmp_path, monkeypatch):
    """The NodeTainted event reaches the cluster although the status says tainted long before the timer runs
    (the taint is queued for the timer, not found by comparing with the status)."""
    lab = Lab(cluster, tmp_path, monkeypatch)
    events = kmock.resource("", "v1", "events")   # in discovery: kopf posts events only once it sees them there
    cluster.on_loop(lambda k: k.resources.__setitem__(events, kmock.ResourceInfo(
        kind="Event", singular="event", namespaced=True, verbs={"get", "list", "create"})))

    def tainted_events() -> list[dict]:
        return cluster.on_loop(lambda k: [dict(o.raw) for (res, ns, name), o in k.objects.items()
                                          if res == events and o.raw.get("reason") == "NodeTainted"])
    with KopfRunner(ARGS, timeout=60) as runner:
        lab.create()
        [pod] = wait_for("the worker pod", lab.pods)
        cluster.on_loop(lambda k: k.objects[PODS, NAMESPACE, pod].patch({"spec": {"nodeName": "gpu-a"},
                                                                         "status": {"phase": "Failed"}}))
        wait_for("tainted in the status", lambda: any(n["tainted"] for n in lab.mirrored()["nodes"]))
        [event] = wait_for("the NodeTainted event", tainted_events)
        assert "gpu-a" in event["message"] and event["type"] == "Warning"
        assert event["involvedObject"]["name"] == "e2e"
        time.sleep(3.5)                 # another timer run (every 3 s): still one event
        assert len(tainted_events()) == 1
        lab.delete()
        wait_for("the TfsnJob to go", lambda: lab.job() is None)
    assert runner.exit_code == 0 and runner.exception is None
