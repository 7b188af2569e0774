"""The Kubernetes driver through the real kubernetes client over HTTP, against kmock's Kubernetes emulator.

kmock stores objects but runs no scheduler nor kubelet: a test plays the kubelet by writing the
pod's status on the server, as a real node would.
"""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Iterator

import pytest
import yaml

pytest.importorskip("kubernetes")
kmock = pytest.importorskip("kmock")

from providers.base import (AuthError, InvalidRequestError, NodeHandle, NodeRequest, NodeStatus, Offer,  # noqa: E402
                            ProviderError, QuotaError)
from providers.kubernetes import GPU, NODE_ANNOTATION, UNHEALTHY_TAINT, KubernetesProvider, PodBinding  # noqa: E402
from providers.naming import dns_label  # noqa: E402
from tests.awsfaults import free_port  # noqa: E402

NAMESPACE = "ml"
PODS = kmock.resource("v1", "pods")
NODES = kmock.resource("v1", "nodes")
SECRETS = kmock.resource("v1", "secrets")


class Cluster:
    """kmock's emulator on a free port, served from its own event loop in a thread."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "kmock did not start"

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            self.emulator, self.url = emulator, f"http://127.0.0.1:{server.port}"
            self._ready.set()
            await self._stop.wait()

    def on_loop(self, change):
        """Run `change(emulator)` on the server's loop, between requests."""
        async def run():
            return change(self.emulator)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def add_node(self, name: str, labels: dict, allocatable: dict, annotations: dict | None = None,
                 unschedulable: bool = False) -> None:
        self.on_loop(lambda k: k.objects.__setitem__((NODES, None, name), {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": labels, "annotations": annotations or {}},
            "spec": {"unschedulable": unschedulable}, "status": {"allocatable": allocatable}}))

    def pod(self, name: str) -> dict | None:
        def read(k):
            key = (PODS, NAMESPACE, name)
            return None if key not in k.objects or k.objects[key].deleted else dict(k.objects[key].raw)
        return self.on_loop(read)

    def set_phase(self, name: str, phase: str) -> None:
        self.on_loop(lambda k: k.objects[PODS, NAMESPACE, name].patch({"status": {"phase": phase}}))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def running_cluster(tmp_path, monkeypatch) -> Iterator[Cluster]:
    """The emulator, and a kubeconfig whose current context points at it with namespace `ml`
    (shared with the operator's tests)."""
    cluster = Cluster()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "lab",
        "clusters": [{"name": "lab", "cluster": {"server": cluster.url}}],
        "users": [{"name": "me", "user": {"token": "not-a-secret"}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "me", "namespace": NAMESPACE}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    for name in ("TFSN_K8S_NAMESPACE", "TFSN_K8S_CONTEXT", "TFSN_K8S_IMAGE", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    yield cluster
    cluster.close()


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    yield from running_cluster(tmp_path, monkeypatch)


def h100(count: int = 8) -> Offer:
    return Offer(provider="kubernetes", region="lab", zone=None,
                 instance_type="nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3", accelerator="H100",
                 accelerator_count=count, accelerator_memory_gib=80, vcpus=96, memory_gib=1000, price=0.0)


def request(node_id: str = "train-1-n0-ab12", offer: Offer | None = None, **kw) -> NodeRequest:
    kw.setdefault("env", {"TFSN_NODE_ID": node_id, "TFSN_CONTROLLER_URL": "http://10.0.0.1:8080"})
    return NodeRequest(job_id="1", node_id=node_id, command=["python", "-m", "orchestrator.agent"],
                       workdir="/workspace", offer=offer or h100(), **kw)


def test_offers_are_the_clusters_gpu_types_priced_by_annotation(cluster):
    gfd = "nvidia.com/gpu.product"
    cluster.add_node("h100-a", {gfd: "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559"},
                     {GPU: "8", "cpu": "96", "memory": "1000Gi"})
    cluster.add_node("h100-b", {gfd: "NVIDIA-H100-80GB-HBM3"}, {GPU: "4", "cpu": "48", "memory": "500Gi"})
    cluster.add_node("h100-c", {gfd: "NVIDIA-H100-80GB-HBM3"}, {GPU: "16", "cpu": "192"}, {}, unschedulable=True)
    cluster.add_node("gke-a100", {"cloud.google.com/gke-accelerator": "nvidia-a100-80gb"},
                     {GPU: "2", "cpu": "24", "memory": "170Gi"}, {"tfsn.dev/price-per-hour": "7.5"})
    cluster.add_node("cpu-1", {}, {"cpu": "16", "memory": "64Gi"})
    offers = {o.instance_type: o for o in KubernetesProvider().offers()}
    assert set(offers) == {"nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
                           "cloud.google.com/gke-accelerator=nvidia-a100-80gb", "cpu"}
    h = offers["nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"]
    assert (h.accelerator, h.accelerator_count, h.vcpus, h.memory_gib, h.price) == ("H100", 8, 96, 1000, 0.0)
    assert round(h.accelerator_memory_gib) == 80 and h.region == "lab" and h.spot_price is None
    a = offers["cloud.google.com/gke-accelerator=nvidia-a100-80gb"]
    assert (a.accelerator, a.accelerator_count, a.price) == ("A100-80GB", 2, 7.5)
    assert a.accelerator_memory_gib == 80  # no memory label on GKE: the accelerator's known memory
    assert (offers["cpu"].accelerator, offers["cpu"].accelerator_count, offers["cpu"].vcpus) == (None, 0, 16)


def test_a_bad_price_annotation_names_the_node(cluster):
    cluster.add_node("h100-a", {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, {GPU: "8"},
                     {"tfsn.dev/price-per-hour": "cheap"})
    with pytest.raises(InvalidRequestError, match="node h100-a: annotation tfsn.dev/price-per-hour='cheap'"):
        KubernetesProvider().offers()


def test_provision_creates_a_gpu_pod_that_runs_the_agent(cluster):
    req = request()
    handle = KubernetesProvider().provision(req)
    assert handle.data == {"namespace": NAMESPACE, "pod": req.node_id, "context": "lab"}
    pod = cluster.pod(req.node_id)
    spec, [container] = pod["spec"], pod["spec"]["containers"]
    assert spec["restartPolicy"] == "Never"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert container["resources"]["limits"] == {GPU: "8"}
    assert container["command"][-3:] == req.command and '"$@"' in container["command"][2]
    assert {e["name"]: e["value"] for e in container["env"] if "value" in e} == req.env
    assert {"name": "TFSN_HOST_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in container["env"]
    assert "affinity" not in spec
    assert pod["metadata"]["labels"]["tfsn-job"] == "1" and pod["metadata"]["labels"]["tfsn-node"] == req.node_id
    assert pod["metadata"]["annotations"][NODE_ANNOTATION] == req.node_id


def test_the_jobs_own_node_selector_tolerations_and_image_add_to_the_gpus(cluster):
    req = request(placement={"image": "ghcr.io/lab/train:1", "node_selector": {"pool": "a100"},
                             "tolerations": [{"key": "lab/reserved", "operator": "Exists", "effect": "NoSchedule"}]})
    KubernetesProvider().provision(req)
    spec = cluster.pod(req.node_id)["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "a100"}
    assert spec["tolerations"] == [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"},
                                   {"key": "lab/reserved", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["containers"][0]["image"] == "ghcr.io/lab/train:1"


def test_a_pod_keeps_off_the_machines_the_health_policy_took_out_of_the_job(cluster):
    req = request(avoid_hosts=("gpu-node-3", "gpu-node-9"))
    KubernetesProvider().provision(req)
    terms = cluster.pod(req.node_id)["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                            "values": ["gpu-node-3", "gpu-node-9"]}]}]


def test_cpu_offer_has_no_gpu_limit_nor_selector_and_namespace_can_be_overridden(cluster, monkeypatch):
    monkeypatch.setenv("TFSN_K8S_NAMESPACE", "other")
    cpu = Offer(provider="kubernetes", region="lab", zone=None, instance_type="cpu", accelerator=None,
                accelerator_count=0, accelerator_memory_gib=0, vcpus=16, memory_gib=64, price=0)
    handle = KubernetesProvider().provision(request(offer=cpu, cpus=4, memory_gib=8))
    assert handle.data["namespace"] == "other"
    pod = cluster.on_loop(lambda k: dict(k.objects[PODS, "other", handle.data["pod"]].raw))
    assert "nodeSelector" not in pod["spec"]
    assert pod["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "4", "memory": "8192Mi"}}


def test_same_node_twice_is_one_pod_and_status_follows_the_phase_across_a_restart(cluster):
    req = request(node_id="My_Job-7-n0-ff01")  # not a valid pod name as is
    first = KubernetesProvider().provision(req)
    second = KubernetesProvider().provision(req)
    assert first == second and first.data["pod"] == dns_label(req.node_id)
    pods = cluster.on_loop(lambda k: [key for key in k.objects.keys() if key[0] == PODS])
    assert len(pods) == 1
    restored = NodeHandle(**json.loads(json.dumps(first.__dict__)))  # a new controller reads the store
    provider = KubernetesProvider()
    assert provider.status(restored) is NodeStatus.PENDING  # no kubelet has reported yet
    for phase, expected in [("Pending", NodeStatus.PENDING), ("Running", NodeStatus.RUNNING),
                            ("Failed", NodeStatus.TERMINATED)]:
        cluster.set_phase(first.data["pod"], phase)
        assert provider.status(restored) is expected


def test_terminate_deletes_the_pod_and_a_missing_pod_is_not_an_error(cluster):
    req = request()
    provider = KubernetesProvider()
    handle = provider.provision(req)
    provider.terminate(handle)
    assert cluster.pod(req.node_id) is None
    assert provider.status(handle) is NodeStatus.TERMINATED
    provider.terminate(handle)


def test_a_pod_of_the_same_name_owned_by_another_node_is_refused(cluster):
    manifest = KubernetesProvider().pod(request(node_id="someone-else"))
    manifest["metadata"]["name"] = "train-1-n0-ab12"
    cluster.on_loop(lambda k: k.objects.__setitem__((PODS, NAMESPACE, "train-1-n0-ab12"), manifest))
    with pytest.raises(InvalidRequestError, match="belongs to something else"):
        KubernetesProvider().provision(request())


def _refuse_create(cluster, status: int, reason: str, message: str) -> None:
    body = {"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": reason, "message": message,
            "code": status}
    cluster.on_loop(lambda k: k[f"post /api/v1/namespaces/{NAMESPACE}/pods"] << status << body)


def test_quota_and_rbac_refusals_are_typed_errors_that_say_what_to_fix(cluster):
    _refuse_create(cluster, 403, "Forbidden", 'pods "train-1-n0-ab12" is forbidden: exceeded quota: gpus, '
                   "requested: requests.nvidia.com/gpu=8, used: requests.nvidia.com/gpu=0, limited: "
                   "requests.nvidia.com/gpu=4")
    with pytest.raises(QuotaError, match="exceeded quota.*To fix: raise the ResourceQuota of namespace ml") as caught:
        KubernetesProvider().provision(request())
    assert caught.value.scope == "region" and "\n" not in str(caught.value)


def test_forbidden_is_an_auth_error(cluster):
    _refuse_create(cluster, 403, "Forbidden", 'pods is forbidden: User "me" cannot create resource "pods"')
    with pytest.raises(AuthError, match="cannot create resource.*To fix: grant") as caught:
        KubernetesProvider().provision(request())
    assert caught.value.scope == "provider"


def test_server_errors_are_retried_and_then_reported_as_retryable(cluster, monkeypatch):
    monkeypatch.setattr("providers.kubernetes.BACKOFF_S", 0.01)
    body = {"kind": "Status", "status": "Failure", "reason": "ServiceUnavailable", "message": "etcd is down"}
    cluster.on_loop(lambda k: k["get /api/v1/nodes"] << 503 << body)
    with pytest.raises(ProviderError, match="503") as caught:
        KubernetesProvider().offers()
    assert caught.value.retryable
    assert cluster.on_loop(lambda k: len(list(k["get /api/v1/nodes"]))) == 1 + 3  # first try + bounded retries


def test_a_create_applied_but_answered_with_an_error_is_adopted_on_retry(cluster, monkeypatch):
    """The API server stored the pod, then the answer was lost (503): the retry's 409 is this node's pod."""
    monkeypatch.setattr("providers.kubernetes.BACKOFF_S", 0.01)
    _refuse_create(cluster, 503, "ServiceUnavailable", "etcd is unavailable")
    req = request()
    handle = KubernetesProvider().provision(req)
    assert handle.data["pod"] == req.node_id
    assert cluster.on_loop(lambda k: len([key for key in k.objects.keys() if key[0] == PODS])) == 1


def test_unreachable_api_server_is_a_retryable_error(cluster, tmp_path, monkeypatch):
    monkeypatch.setattr("providers.kubernetes.BACKOFF_S", 0.01)
    config = tmp_path / "down"
    config.write_text((tmp_path / "kubeconfig").read_text().replace(cluster.url, f"http://127.0.0.1:{free_port()}"))
    monkeypatch.setenv("KUBECONFIG", str(config))
    with pytest.raises(ProviderError, match="cannot reach the Kubernetes API") as caught:
        KubernetesProvider().provision(request())
    assert caught.value.retryable
    assert KubernetesProvider().status(NodeHandle("kubernetes", "x", {"pod": "x", "namespace": "ml"})) \
        is NodeStatus.UNKNOWN


def test_no_kubeconfig_is_a_one_line_auth_error(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(AuthError, match="no Kubernetes cluster configured.*To fix: set KUBECONFIG") as caught:
        KubernetesProvider().provision(request())
    assert "\n" not in str(caught.value)


def test_spot_is_refused(cluster):
    with pytest.raises(InvalidRequestError, match="no spot market"):
        KubernetesProvider().provision(request(spot=True))


def binding(**kw) -> PodBinding:
    return PodBinding(**{"namespace": "team-a", "owner": {"apiVersion": "tfsn.dev/v1alpha1", "kind": "TfsnJob",
                                                          "name": "llm", "uid": "u-1"},
                         "token_secret": "llm-token", "service": "llm-workers", "checkpoint_path": "/ckpt",
                         "command": ("python3", "-m", "orchestrator.agent"), **kw})


def test_a_bound_pod_is_owned_gets_its_token_from_a_secret_and_only_the_agents_settings(cluster):
    provider = KubernetesProvider()
    provider.bindings["1"] = binding()
    provider.apply("Secret", "team-a", {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "llm-token"},
                                        "stringData": {"token": "the-jobs-own"}})   # as the operator makes it
    req = request(env={"TFSN_TOKEN": "s3cret", "TFSN_NODE_ID": "train-1-n0-ab12", "PATH": "/operator/bin"})
    handle = provider.provision(req)
    assert handle.data["namespace"] == "team-a"   # next to its TfsnJob, not in the kubeconfig's namespace
    pod = cluster.on_loop(lambda k: dict(k.objects[PODS, "team-a", handle.data["pod"]].raw))
    [container] = pod["spec"]["containers"]
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert container["env"] == [
        {"name": "TFSN_NODE_ID", "value": "train-1-n0-ab12"},
        {"name": "TFSN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "llm-token", "key": "agent-train-1-n0-ab12"}}},
        {"name": "TFSN_HOST_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    assert container["command"][-3:] == ["python3", "-m", "orchestrator.agent"]
    assert pod["spec"]["volumes"] == [{"name": "checkpoints", "emptyDir": {}}]  # no claim named
    assert container["volumeMounts"] == [{"name": "checkpoints", "mountPath": "/ckpt"}]
    assert "s3cret" not in json.dumps(pod)   # the node's own token is in the Secret, next to the job's
    secret = cluster.on_loop(lambda k: dict(k.objects[SECRETS, "team-a", "llm-token"].raw))
    assert set(secret.get("stringData") or secret.get("data")) == {"token", "agent-train-1-n0-ab12"}


def test_taint_keeps_the_nodes_other_taints_and_happens_once(cluster):
    cluster.add_node("gpu-a", {}, {GPU: "8"})
    cluster.on_loop(lambda k: k.objects[NODES, None, "gpu-a"].patch({"spec": {"taints": [
        {"key": GPU, "value": "present", "effect": "NoSchedule"}]}}))
    provider = KubernetesProvider()
    assert provider.taint("gpu-a", "Xid 79 on GPU 3") is True
    node = cluster.on_loop(lambda k: dict(k.objects[NODES, None, "gpu-a"].raw))
    assert node["spec"]["taints"] == [{"key": GPU, "value": "present", "effect": "NoSchedule"},
                                      {"key": UNHEALTHY_TAINT, "value": "true", "effect": "NoSchedule"}]
    assert node["metadata"]["annotations"][UNHEALTHY_TAINT + "-reason"] == "Xid 79 on GPU 3"
    assert provider.taint("gpu-a", "again") is False


def test_the_host_of_a_deleted_pod_is_remembered(cluster):
    provider = KubernetesProvider()
    handle = provider.provision(request())
    cluster.on_loop(lambda k: k.objects[PODS, NAMESPACE, handle.data["pod"]].patch({"spec": {"nodeName": "gpu-b"}}))
    provider.terminate(handle)   # the delete's answer still names the node the pod ran on
    assert provider.hosts == {handle.node_id: "gpu-b"}


def test_services_and_secrets_are_created_once(cluster):
    provider = KubernetesProvider()
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "t"}, "stringData": {"token": "a"}}
    provider.apply("Secret", NAMESPACE, secret)
    provider.apply("Secret", NAMESPACE, secret)   # 409 from the server: already there
    provider.replace_secret_data(NAMESPACE, "t", {"token": "b"})
    stored = cluster.on_loop(lambda k: dict(k.objects[kmock.resource("v1", "secrets"), NAMESPACE, "t"].raw))
    assert stored["stringData"] == {"token": "b"}
