"""The operator's handlers' work (orchestrator.k8s.operator.Operator) against kmock's Kubernetes emulator.

Everything goes through the real kubernetes client over HTTP and the real controller. kmock runs no
scheduler, kubelet nor garbage collector: a test schedules and fails pods by writing their spec and
status on the server, plays kopf by writing what a handler returns into the TfsnJob's status, and plays
the node agents by calling the controller's API (or its handlers).
"""
from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import threading
import time

import pytest
import yaml

pytest.importorskip("kubernetes")
kmock = pytest.importorskip("kmock")
kopf = pytest.importorskip("kopf")

from orchestrator.k8s import crd
from orchestrator.k8s import operator as k8s_operator  # noqa: E402
from orchestrator.control.credentials import agent_token, sdk_token  # noqa: E402
from orchestrator.sdk.client import CA_FINGERPRINT_ENV, CA_PEM_ENV, ControllerClient  # noqa: E402
from orchestrator.k8s.runtime import CLAIM_ANNOTATION, Operator, OperatorSettings  # noqa: E402
from orchestrator.k8s.status import StatusWriter, status_patch  # noqa: E402
from orchestrator.spec import JobSpec  # noqa: E402
from orchestrator.control.store import JobState, NodeState  # noqa: E402
from providers.kubernetes import GPU, UNHEALTHY_TAINT  # noqa: E402
from tests.awsfaults import free_port  # noqa: E402
from tests.test_provider_kubernetes import NAMESPACE, NODES, PODS, running_cluster  # noqa: E402

PRODUCT = "NVIDIA-H100-80GB-HBM3"
ADVERTISE = "tfsn-operator.tfsn-system.svc"   # never resolved: the tests play the agents
SERVICES = kmock.resource("v1", "services")
SECRETS = kmock.resource("v1", "secrets")
TFSNJOBS = kmock.resource(crd.GROUP, crd.VERSION, crd.PLURAL)
WAIT_S = 10.0       # every wait ends as soon as its condition holds


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    clusters = running_cluster(tmp_path, monkeypatch)
    cluster = next(clusters)
    cluster.on_loop(lambda k: k.resources.__setitem__(TFSNJOBS, kmock.ResourceInfo(
        kind=crd.KIND, singular="tfsnjob", namespaced=True, subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"})))
    yield cluster
    next(clusters, None)


def new_operator(home, host: str = "127.0.0.1") -> Operator:
    return Operator(OperatorSettings(home=home, host=host, advertise=ADVERTISE, pod_poll_s=0))


def client(op: Operator, token: str, job_id: int) -> ControllerClient:
    """A client of the operator's API as its pods reach it (TLS: it advertises an address beyond loopback),
    connecting over loopback."""
    authority = op.server.authority
    return ControllerClient(f"https://127.0.0.1:{op.server.server_address[1]}", token, job_id,
                            ca_pem=authority.ca_pem, ca_fingerprint=authority.fingerprint)


def add_gpu_nodes(cluster) -> None:
    for host in ("gpu-a", "gpu-b"):
        cluster.add_node(host, {"nvidia.com/gpu.product": PRODUCT}, {GPU: "8", "cpu": "96", "memory": "1000Gi"})


@pytest.fixture
def operator(cluster, tmp_path):
    add_gpu_nodes(cluster)
    op = new_operator(tmp_path / "operator")
    yield op
    op.close()


def tfsnjob(name: str = "llm", uid: str = "1b4e28ba-2fa1-11d2-883f-0016d3cca427", **spec) -> dict:
    return {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND,
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid,
                         "annotations": {CLAIM_ANNOTATION: "checkpoints"}},
            "spec": {"run": "python train.py", "resources": {"accelerators": "H100:8"},
                     "checkpoint": {"dir": "/ckpt"}, **spec}}


def objects(cluster, resource) -> dict[str, dict]:
    """The objects of `resource` in the test namespace, by name, as the server holds them."""
    return cluster.on_loop(lambda k: {name: dict(obj.raw) for (res, ns, name), obj in k.objects.items()
                                      if res == resource and ns == NAMESPACE and not obj.deleted})


def pods(cluster) -> dict[str, dict]:
    return objects(cluster, PODS)


def on_server(cluster, body: dict) -> dict:
    """The TfsnJob as the API server holds it (the status the operator wrote)."""
    return json.loads(json.dumps(objects(cluster, TFSNJOBS)[body["metadata"]["name"]]))


def kopf_writes(cluster, body: dict, changes: dict) -> dict:
    """What kopf does with a handler's return: merge it into the TfsnJob's status."""
    name = body["metadata"]["name"]
    cluster.on_loop(lambda k: k.objects[TFSNJOBS, NAMESPACE, name].patch({"status": changes}))
    return on_server(cluster, body)


def admitted(op: Operator, cluster, body: dict) -> tuple[dict, int]:
    """The TfsnJob created on the server and through the create handler, and its controller job id."""
    cluster.on_loop(lambda k: k.objects.__setitem__((TFSNJOBS, NAMESPACE, body["metadata"]["name"]), body))
    kopf_writes(cluster, body, op.admit(body))
    [job] = [j for j in op.store.jobs() if j.spec_path.endswith(body["metadata"]["uid"])]
    assert op.writer.write(job.id)
    return on_server(cluster, body), job.id


def job_ids(op: Operator, body: dict) -> list[int]:
    return [j.id for j in op.store.jobs() if j.spec_path.endswith(body["metadata"]["uid"])]


def synced(op: Operator, cluster, body: dict) -> dict:
    """The timer handler run once, then what the status writer's thread does with it (not started here)."""
    conditions = op.sync(on_server(cluster, body))
    for job_id in job_ids(op, body):
        assert op.writer.write(job_id)
    return kopf_writes(cluster, body, conditions)


def wait_for(what: str, check, timeout_s: float = WAIT_S, poll_s: float = 0.05):
    """`check()`'s first truthy value, polled until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def schedule(cluster, pod: str, host: str, phase: str = "Running") -> None:
    cluster.on_loop(lambda k: k.objects[PODS, NAMESPACE, pod].patch({"spec": {"nodeName": host},
                                                                     "status": {"phase": phase}}))


def run_first_attempt(op: Operator, cluster, job_id: int, host: str = "gpu-a") -> str:
    """Provision, schedule on `host`, agent ready: the job RUNNING on one pod, whose name is returned."""
    op.controller.reconcile(job_id)
    [pod] = pods(cluster)
    schedule(cluster, pod, host)
    [node] = op.store.nodes(job_id, active_only=True)
    op.controller.handlers.heartbeat(job_id, node.id, {"state": "ready", "host": host})
    op.controller.reconcile(job_id)
    assert op.store.job(job_id).state == JobState.RUNNING
    return pod


def test_a_new_tfsnjob_yields_gpu_pods_owned_by_it_with_the_token_from_a_secret_and_a_headless_service(
        operator, cluster):
    body, job_id = admitted(operator, cluster, tfsnjob(num_nodes=2, kubernetes={
        "node_selector": {"pool": "training"}, "tolerations": [{"key": "lab/reserved", "operator": "Exists"}]}))
    assert (body["status"]["phase"], body["status"]["jobId"]) == ("Pending", job_id)
    conditions = {c["type"]: c["status"] for c in body["status"]["conditions"]}
    assert conditions == {"Valid": "True", "CheckpointsDurable": "True"}
    operator.controller.reconcile(job_id)
    assert operator.store.job(job_id).state == JobState.PROVISIONING, operator.store.job(job_id).error
    made = pods(cluster)
    assert len(made) == 2
    token = operator.store.job(job_id).token
    [service] = objects(cluster, SERVICES).values()
    [secret] = objects(cluster, SECRETS).values()
    assert secret["stringData"] == {"token": token, **{f"agent-{n}": agent_token(token, n) for n in made}}
    assert service["spec"]["clusterIP"] == "None"
    for name, pod in made.items():
        meta, spec, [container] = pod["metadata"], pod["spec"], pod["spec"]["containers"]
        [owner] = meta["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            crd.KIND, "llm", body["metadata"]["uid"], True)
        assert container["resources"]["limits"] == {GPU: "8"}
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": PRODUCT, "pool": "training"}  # the spec's own too
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert {"key": "lab/reserved", "operator": "Exists"} in spec["tolerations"]
        env = {e["name"]: e for e in container["env"]}
        assert env["TFSN_TOKEN"] == {"name": "TFSN_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": secret["metadata"]["name"], "key": f"agent-{name}"}}}   # the node's own token
        assert token not in json.dumps(pod) and agent_token(token, name) not in json.dumps(pod)  # never plain
        assert env["TFSN_CONTROLLER_URL"]["value"] == operator.server.url
        assert all(k.startswith("TFSN_") for k in env)  # not the operator's own environment
        assert spec["volumes"] == [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "checkpoints"}}]
        assert container["volumeMounts"] == [{"name": "checkpoints", "mountPath": "/ckpt", "subPath": "llm"}]
        assert (spec["subdomain"], spec["hostname"]) == (service["metadata"]["name"], name)
        assert service["spec"]["selector"].items() <= meta["labels"].items()  # the Service finds them


def test_a_failed_pod_taints_its_node_and_the_job_restarts_on_a_new_pod(operator, cluster):
    body, job_id = admitted(operator, cluster, tfsnjob())
    first = run_first_attempt(operator, cluster, job_id)
    operator.controller.handlers.checkpoint(job_id, {"step": 40, "path": "/ckpt/step-40"})
    schedule(cluster, first, "gpu-a", phase="Failed")  # e.g. the GPU fell off the bus and the agent died
    operator.controller.reconcile(job_id)              # fails the node and deletes its pod
    node = cluster.on_loop(lambda k: dict(k.objects[NODES, None, "gpu-a"].raw))
    assert UNHEALTHY_TAINT in [t["key"] for t in node["spec"]["taints"]]   # before any replacement is asked for
    for _ in range(2):                                 # recover, provision the replacement
        operator.controller.reconcile(job_id)
    job = operator.store.job(job_id)
    assert (job.state, job.restarts) == (JobState.RECOVERING, 1)
    body = synced(operator, cluster, body)
    status = body["status"]
    assert status["restarts"] == 1 and status["phase"] == "Recovering"
    assert status["checkpoint"] == {"step": 40, "path": "/ckpt/step-40"}
    failed = next(n for n in status["nodes"] if n["state"] == "FAILED")
    assert (failed["host"], failed["tainted"], failed["pod"]) == ("gpu-a", True, first)
    node = cluster.on_loop(lambda k: dict(k.objects[NODES, None, "gpu-a"].raw))
    assert {"key": UNHEALTHY_TAINT, "value": "true", "effect": "NoSchedule"} in node["spec"]["taints"]
    assert "agent exited" in node["metadata"]["annotations"][UNHEALTHY_TAINT + "-reason"]
    other = cluster.on_loop(lambda k: dict(k.objects[NODES, None, "gpu-b"].raw))
    assert not other["spec"].get("taints")
    [second] = pods(cluster)
    assert second != first
    assert "nodeName" not in pods(cluster)[second]["spec"]  # left to the scheduler, which the taint keeps off gpu-a
    assert synced(operator, cluster, body)["status"] == status  # nothing new: the node is tainted once


def test_a_gpu_health_finding_reported_by_the_agent_taints_the_node_and_replaces_the_pod(operator, cluster):
    """The agent's NVML samples reach the operator's API as they reach a local controller: same policy."""
    operator.start(reconcile=False)
    body, job_id = admitted(operator, cluster, tfsnjob())
    first = run_first_attempt(operator, cluster, job_id)
    [node] = operator.store.nodes(job_id)
    token = operator.store.job(job_id).token
    agent = client(operator, agent_token(token, node.id), job_id)
    agent.post(f"/nodes/{node.id}/samples", {"samples": [{"time": time.time(), "node": node.id, "gpu": 3, "xid": 79}]})
    operator.controller.reconcile(job_id)      # the policy: checkpoint first, then replace the node
    job = operator.store.job(job_id)
    assert job.pending_replace == node.id and job.checkpoint_request > 0
    client(operator, sdk_token(token), job_id).post("/checkpoint", {"step": 120, "path": "/ckpt/step-120",
                                                                    "seconds": 0.5})  # the SDK saved it
    for _ in range(3):
        operator.controller.reconcile(job_id)
    assert operator.store.job(job_id).restarts == 1
    status = synced(operator, cluster, body)["status"]
    failed = next(n for n in status["nodes"] if n["state"] == "FAILED")
    assert failed["tainted"] and failed["host"] == "gpu-a" and "xid" in failed["failure"].lower()
    assert status["checkpoint"]["step"] == 120
    [second] = pods(cluster)
    assert second != first


def test_without_a_checkpoint_claim_the_job_runs_and_says_its_checkpoints_do_not_outlive_a_pod(operator, cluster):
    job = tfsnjob()
    del job["metadata"]["annotations"]
    body, job_id = admitted(operator, cluster, job)
    [condition] = [c for c in body["status"]["conditions"] if c["type"] == "CheckpointsDurable"]
    assert condition["status"] == "False" and f"To fix: annotate the TfsnJob with {CLAIM_ANNOTATION}" in \
        condition["message"]
    operator.controller.reconcile(job_id)
    [pod] = pods(cluster).values()
    assert pod["spec"]["volumes"] == [{"name": "checkpoints", "emptyDir": {}}]
    assert condition in synced(operator, cluster, body)["status"]["conditions"]   # kept by the status sync


def _untimed(status: dict) -> dict:
    return {**status, "conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                                     for c in status["conditions"]]}


def test_a_create_handler_run_twice_makes_one_job_and_a_spec_change_is_reported_not_applied(
        operator, cluster):
    body, job_id = admitted(operator, cluster, tfsnjob())
    # kopf retries a handler whose progress it lost: the same conditions (each stamped when it is made)
    assert _untimed(operator.admit(body)) == _untimed(operator.admit(body))
    assert [j.id for j in operator.store.jobs()] == [job_id]
    kopf_writes(cluster, body, operator.spec_changed(body))
    body = synced(operator, cluster, body)
    changed = next(c for c in body["status"]["conditions"] if c["type"] == "SpecApplied")
    assert changed["status"] == "False" and "To fix: kubectl delete the TfsnJob" in changed["message"]
    assert operator.store.job(job_id).spec["run"] == "python train.py"


def test_max_restarts_is_honoured(operator, cluster):
    body, job_id = admitted(operator, cluster, tfsnjob(recovery={"max_restarts": 0}))
    first = run_first_attempt(operator, cluster, job_id)
    schedule(cluster, first, "gpu-a", phase="Failed")
    for _ in range(3):
        operator.controller.reconcile(job_id)
    status = synced(operator, cluster, body)["status"]
    assert (status["phase"], status["restarts"]) == ("Failed", 0)
    assert "recovery.max_restarts" in status["message"]
    assert pods(cluster) == {}


def test_deleting_a_tfsnjob_stops_the_job_and_deletes_its_pods(operator, cluster):
    body, job_id = admitted(operator, cluster, tfsnjob(num_nodes=2))
    operator.controller.reconcile(job_id)
    assert len(pods(cluster)) == 2
    assert operator.release(body) is False   # the finalizer stays until the controller has stopped it
    operator.controller.reconcile(job_id)
    assert operator.store.job(job_id).state == JobState.STOPPED
    assert pods(cluster) == {}
    assert operator.release(body) is True
    assert str(job_id) not in operator.provider.bindings


@pytest.mark.parametrize("spec, message", [
    ({"num_nodes": 0}, r"spec\.num_nodes: Input should be greater than or equal to 1"),
    ({"resources": {"accelerators": "H100:eight"}},
     r"spec\.resources\.accelerators: accelerator count 'eight' .* To fix: write it like 'H100:8'"),
    ({"nodes": 2}, r"spec\.nodes: unknown field"),
    ({"resources": {"accelerators": "H100:8", "infra": ["aws"]}}, r"spec\.resources\.infra: .*To fix: remove"),
    ({"checkpoint": {"dir": "ckpt"}}, r"spec\.checkpoint\.dir: 'ckpt' is relative.*To fix"),
    ({"num_nodes": 10**32}, r"spec\.num_nodes: Input should be less than or equal to 4096"),
    ({"envs": {"SEED": "1\x00"}}, r"spec\.envs\.SEED: a control character \(U\+0000\) .*To fix: remove it"),
])
def test_an_invalid_tfsnjob_gets_a_condition_that_says_what_to_fix_and_no_pods(operator, cluster, spec,
                                                                                message):
    status = operator.admit(tfsnjob(**spec))
    [condition] = status["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == ("Valid", "False", "InvalidSpec")
    assert re.search(message, condition["message"]) and "\n" not in condition["message"]
    assert status["phase"] == "Failed" and status["jobId"] is None
    assert operator.store.jobs() == [] and pods(cluster) == {}


def test_a_validator_bug_is_a_condition_not_an_error_kopf_retries_forever(operator, cluster, monkeypatch):
    """Only a ValidationError was caught: a bug in one of the spec's validators (here a duration parser that raises)
    left the create handler raising, which kopf retries with a traceback every time; `tfsn launch` says it in one
    line, and so does the TfsnJob's condition."""
    from orchestrator import spec as spec_module

    def broken(text):
        raise ZeroDivisionError("division by zero")
    monkeypatch.setattr(spec_module, "parse_duration", broken)
    status = operator.admit(tfsnjob(health={"thresholds": {"hang_min_s": "2 min"}}))
    [condition] = status["conditions"]
    assert (condition["reason"], status["phase"], status["jobId"]) == ("InvalidSpec", "Failed", None)
    assert "cannot validate the spec: ZeroDivisionError: division by zero" in condition["message"]
    assert "\n" not in condition["message"] and operator.store.jobs() == [] and pods(cluster) == {}


def test_a_tfsnjob_fills_names_in_its_paths_from_its_own_envs_and_refuses_one_not_there(operator, cluster,
                                                                                       monkeypatch):
    """`checkpoint.dir: s3://${BUCKET}/run1` was taken as written: a bucket named '${BUCKET}'. A file fills $NAME from
    its envs, else the launching shell; a TfsnJob has no launching shell (the operator's environment is not the
    user's), so its own envs alone, and a name not there is refused before any pod."""
    monkeypatch.setenv("BUCKET", "the-operators-own")
    monkeypatch.setenv("RUN", "the-operators-run")
    body, job_id = admitted(operator, cluster, tfsnjob(envs={"BUCKET": "team-a", "RUN": "run1", "CKPT": "/ckpt"},
                                                       checkpoint={"dir": "s3://${BUCKET}/$RUN"}))
    assert operator.store.job(job_id).spec["checkpoint"]["dir"] == "s3://team-a/run1"
    body, job_id = admitted(operator, cluster, tfsnjob(name="local", uid="2b4e28ba-2fa1-11d2-883f-0016d3cca427",
                                                       envs={"CKPT": "/ckpt"}, checkpoint={"dir": "$CKPT/local"}))
    assert operator.store.job(job_id).spec["checkpoint"]["dir"] == "/ckpt/local"
    assert operator.prepare(body, operator.store.job(job_id)).checkpoint_path == "/ckpt/local"   # the volume's mount
    status = operator.admit(tfsnjob(name="unset", uid="3b4e28ba-2fa1-11d2-883f-0016d3cca427",
                                    checkpoint={"dir": "s3://${BUCKET}/run1"}))
    [condition] = status["conditions"]
    assert (condition["reason"], status["phase"], status["jobId"]) == ("InvalidSpec", "Failed", None)
    assert condition["message"] == (
        "spec.checkpoint.dir: 's3://${BUCKET}/run1' names $BUCKET, which is not in envs (a TfsnJob has no launching "
        "shell to take it from). To fix: add BUCKET to envs, or write the path out")
    assert len(operator.store.jobs()) == 2 and "unset" not in json.dumps(pods(cluster))


def test_a_refused_tfsnjob_edited_as_its_condition_says_is_checked_again_and_admitted(operator, cluster):
    """Valid=False said "To fix: add BUCKET to envs", and the TfsnJob so edited stayed Failed, no job, the old message:
    an edit was only reported as not applied to a job under way, and a refused TfsnJob has none."""
    body = tfsnjob(checkpoint={"dir": "s3://${BUCKET}/run1"})
    cluster.on_loop(lambda k: k.objects.__setitem__((TFSNJOBS, NAMESPACE, "llm"), body))
    body = kopf_writes(cluster, body, operator.admit(body))
    assert body["status"]["phase"] == "Failed" and operator.store.jobs() == []

    def edited(spec: dict) -> dict:
        cluster.on_loop(lambda k: k.objects[TFSNJOBS, NAMESPACE, "llm"].patch({"spec": spec}))
        return kopf_writes(cluster, body, operator.spec_changed(on_server(cluster, body)))

    body = edited({"envs": {"BUCKET": "team-a"}, "num_nodes": 0})      # another problem: said instead
    [valid] = body["status"]["conditions"]
    assert valid["status"] == "False" and valid["message"].startswith("spec.num_nodes: ") and \
        body["status"]["message"] == valid["message"] and operator.store.jobs() == []
    body = edited({"num_nodes": 1})
    [job] = operator.store.jobs()
    assert job.spec["checkpoint"]["dir"] == "s3://team-a/run1"
    valid = next(c for c in body["status"]["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "True" and (body["status"]["phase"], body["status"]["message"]) == ("", "")
    assert operator.writer.write(job.id) and on_server(cluster, body)["status"]["phase"] == "Pending"


def test_the_status_carries_the_jobs_nodes_and_counts_as_soon_as_they_change(operator, cluster):
    """No timer runs here: the store's writes reach .status through the operator's status writer."""
    operator.start(reconcile=False)
    body, job_id = admitted(operator, cluster, tfsnjob(recovery={"max_restarts": 2}))
    first = run_first_attempt(operator, cluster, job_id)

    def status_where(check):
        return wait_for("the status", lambda: check(on_server(cluster, body)["status"]) and
                        on_server(cluster, body)["status"])

    status = status_where(lambda s: s["phase"] == "Running" and s["nodes"] and s["nodes"][0]["state"] == "READY")
    [node] = status["nodes"]
    [stored] = operator.store.nodes(job_id)
    assert (node["id"], node["rank"], node["pod"], node["host"], node["heard"]) == (stored.id, 0, first, "gpu-a", True)
    assert (status["attempt"], status["restarts"], status["record"]["attemptState"]) == (1, 0, "running")
    assert status["record"]["plan"] == operator.store.job(job_id).plan and status["record"]["plan"]
    started_with = JobSpec.model_validate(operator.store.job(job_id).spec)
    assert JobSpec.model_validate(status["record"]["spec"]) == started_with
    operator.controller.handlers.checkpoint(job_id, {"step": 40, "path": "/ckpt/step-40"})
    saved = status_where(lambda s: s["checkpoint"].get("step") == 40)["checkpoint"]
    assert saved == {"step": 40, "path": "/ckpt/step-40"}
    schedule(cluster, first, "gpu-a", phase="Failed")
    for _ in range(3):
        operator.controller.reconcile(job_id)
    status = status_where(lambda s: s["restarts"] == 1 and len(s["nodes"]) == 2)
    assert status["phase"] == "Recovering"
    failed = next(n for n in status["nodes"] if n["id"] == node["id"])
    assert (failed["state"], failed["tainted"]) == ("FAILED", True)
    assert status["record"]["lastFailure"] == operator.store.job(job_id).last_failure


def test_a_status_write_sets_only_the_keys_that_changed_and_keeps_their_nulls():
    old = {"phase": "Running", "checkpoint": {"step": 40, "path": "/ckpt/40"}, "conditions": [{"type": "Valid"}]}
    new = {"phase": "Running", "checkpoint": {"step": None, "path": ""}, "jobId": 3}
    assert status_patch(old, new) == [{"op": "add", "path": "/status/checkpoint", "value": {"step": None, "path": ""}},
                                      {"op": "add", "path": "/status/jobId", "value": 3}]
    assert status_patch(new, new) == []


def fail_over_to_a_new_operator(operator: Operator, tmp_path, name: str = "new-operator") -> Operator:
    """The operator's pod replaced: the old one stops, its store (an emptyDir) is gone, the new one starts."""
    operator.close()
    successor = new_operator(tmp_path / name)
    successor.start(reconcile=False)
    successor.adoption.adopt_all()
    return successor


def test_an_operator_with_an_empty_home_adopts_the_running_pods_and_takes_their_agents_reports(
        operator, cluster, tmp_path):
    body, job_id = admitted(operator, cluster, tfsnjob())
    pod = run_first_attempt(operator, cluster, job_id)
    cluster.on_loop(lambda k: k.objects[PODS, NAMESPACE, pod].patch({"metadata": {"uid": "pod-uid-1"}}))
    operator.controller.handlers.checkpoint(job_id, {"step": 40, "path": "/ckpt/step-40"})
    [node] = operator.store.nodes(job_id)
    token = operator.store.job(job_id).token
    assert operator.writer.write(job_id)
    # a pod the status never recorded (made just before the old operator died): not the job's any more
    stray = {**pods(cluster)[pod], "metadata": {**pods(cluster)[pod]["metadata"], "name": "llm-stray", "uid": "x"}}
    cluster.on_loop(lambda k: k.objects.__setitem__((PODS, NAMESPACE, "llm-stray"), stray))
    successor = fail_over_to_a_new_operator(operator, tmp_path)
    try:
        assert set(pods(cluster)) == {pod} and pods(cluster)[pod]["metadata"]["uid"] == "pod-uid-1"  # kept, as is
        [job] = successor.store.jobs()
        assert (job.id, job.state, job.attempt, job.restarts, job.token) == (job_id, JobState.RUNNING, 1, 0, token)
        assert (job.checkpoint_step, job.checkpoint_path) == (40, "/ckpt/step-40")
        [adopted] = successor.store.nodes(job.id)
        assert (adopted.id, adopted.rank, adopted.state, adopted.host) == (node.id, 0, NodeState.READY, "gpu-a")
        # the pod's agent, reporting with the token it was started with, to the new operator's API
        agent = client(successor, agent_token(token, node.id), job_id)
        command = agent.post(f"/nodes/{node.id}/heartbeat", {"state": "running", "host": "gpu-a"})
        assert (command["action"], command["attempt"]) == ("run", 1)
        assert agent.post(f"/nodes/{node.id}/attempt", {"attempt": 1})["node_rank"] == 0
        client(successor, sdk_token(token), job_id).post("/checkpoint", {"step": 60, "path": "/ckpt/step-60",
                                                                         "seconds": 0.5})
        successor.controller.reconcile(job.id)
        assert successor.store.job(job.id).state == JobState.RUNNING and set(pods(cluster)) == {pod}
        status = wait_for("the status", lambda: on_server(cluster, body)["status"]["checkpoint"].get("step") == 60
                          and on_server(cluster, body)["status"])
        assert (status["jobId"], status["attempt"], status["phase"]) == (job_id, 1, "Running")
        # kopf's resume handler: the same job, nothing new
        assert successor.adoption.adopt(on_server(cluster, body)) == {}
        assert len(successor.store.jobs()) == 1
    finally:
        successor.close()


def test_the_operators_api_serves_tls_with_a_ca_kept_in_a_secret_so_a_successor_keeps_the_pods_trust(
        cluster, tmp_path):
    add_gpu_nodes(cluster)
    first = new_operator(tmp_path / "operator", host="0.0.0.0")   # in its pod: the pods must reach it
    try:
        body, job_id = admitted(first, cluster, tfsnjob())
        pod = run_first_attempt(first, cluster, job_id)
        [container] = pods(cluster)[pod]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        authority = first.server.authority
        assert env["TFSN_CONTROLLER_URL"] == f"https://{ADVERTISE}:{first.server.server_address[1]}"
        assert (env[CA_PEM_ENV], env[CA_FINGERPRINT_ENV]) == (authority.ca_pem, authority.fingerprint)
        kept = objects(cluster, SECRETS)[crd.CA_SECRET]["stringData"]   # in the operator's own namespace
        assert kept["ca.pem"] == authority.ca_pem and "PRIVATE KEY" in kept["ca.key"]
        token, [node] = first.store.job(job_id).token, first.store.nodes(job_id)
        assert first.writer.write(job_id)
    finally:
        first.close()
    successor = new_operator(tmp_path / "successor", host="0.0.0.0")   # its home (an emptyDir) is new
    try:
        successor.start(reconcile=False)
        successor.adoption.adopt_all()
        assert successor.server.authority.fingerprint == env[CA_FINGERPRINT_ENV]
        # the pod's agent, pinned to the CA it was started with, reports to the new operator
        agent = ControllerClient(f"https://127.0.0.1:{successor.server.server_address[1]}", agent_token(token, node.id),
                                 job_id, ca_pem=env[CA_PEM_ENV], ca_fingerprint=env[CA_FINGERPRINT_ENV])
        command = agent.post(f"/nodes/{node.id}/heartbeat", {"state": "running", "host": "gpu-a"})
        assert (command["action"], command["attempt"]) == ("run", 1)
    finally:
        successor.close()


def test_restarts_and_max_restarts_count_across_operator_restarts_and_a_tainted_node_stays_avoided(
        operator, cluster, tmp_path):
    body, job_id = admitted(operator, cluster, tfsnjob(recovery={"max_restarts": 1}))
    first = run_first_attempt(operator, cluster, job_id)
    schedule(cluster, first, "gpu-a", phase="Failed")
    for _ in range(3):                     # fail the node (taint gpu-a), recover, ask for a replacement
        operator.controller.reconcile(job_id)
    assert operator.store.job(job_id).restarts == 1
    [replacement] = pods(cluster)
    assert operator.writer.write(job_id)
    successor = fail_over_to_a_new_operator(operator, tmp_path)
    try:
        job = successor.store.job(job_id)
        assert (job.state, job.restarts) == (JobState.RECOVERING, 1)
        assert set(pods(cluster)) == {replacement}      # the replacement asked for before the restart is kept
        status = on_server(cluster, body)["status"]
        assert next(n for n in status["nodes"] if n["pod"] == first)["tainted"]
        schedule(cluster, replacement, "gpu-b")
        node = next(n for n in successor.store.nodes(job_id) if n.state == NodeState.STARTING)
        successor.controller.handlers.heartbeat(job_id, node.id, {"state": "ready", "host": "gpu-b"})
        successor.controller.reconcile(job_id)
        assert (successor.store.job(job_id).state, successor.store.job(job_id).attempt) == (JobState.RUNNING, 2)
        schedule(cluster, replacement, "gpu-b", phase="Failed")
        for _ in range(3):
            successor.controller.reconcile(job_id)
        job = successor.store.job(job_id)
        assert job.state == JobState.FAILED and "gave up after 1 restart(s)" in job.error
        assert pods(cluster) == {}
        status = wait_for("the status", lambda: on_server(cluster, body)["status"]["phase"] == "Failed"
                          and on_server(cluster, body)["status"])
        assert status["restarts"] == 1 and "recovery.max_restarts" in status["message"]
        tainted = {n["host"] for n in status["nodes"] if n["tainted"]}
        assert tainted == {"gpu-a", "gpu-b"}
    finally:
        successor.close()


def test_a_tainted_hosts_exclusion_outlives_the_operator(operator, cluster, tmp_path):
    """A node the health policy replaced keeps its machine out of the job after the operator is replaced."""
    operator.start(reconcile=False)
    body, job_id = admitted(operator, cluster, tfsnjob())
    run_first_attempt(operator, cluster, job_id)
    [node] = operator.store.nodes(job_id)
    token = operator.store.job(job_id).token
    agent = client(operator, agent_token(token, node.id), job_id)
    agent.post(f"/nodes/{node.id}/samples", {"samples": [{"time": time.time(), "node": node.id, "gpu": 3, "xid": 79}]})
    operator.controller.reconcile(job_id)
    client(operator, sdk_token(token), job_id).post("/checkpoint", {"step": 120, "path": "/ckpt/step-120",
                                                                    "seconds": 0.5})
    operator.controller.reconcile(job_id)      # fails the node, taints gpu-a
    assert operator.store.job(job_id).health["excluded"] == [node.id]
    assert pods(cluster) == {}
    successor = fail_over_to_a_new_operator(operator, tmp_path)
    try:
        successor.controller.reconcile(job_id)     # recover, then ask for the replacement
        successor.controller.reconcile(job_id)
        [pod] = pods(cluster).values()
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["gpu-a"]
        assert successor.store.job(job_id).checkpoint_step == 120
    finally:
        successor.close()


def test_a_status_without_a_record_restarts_the_job_from_its_checkpoint(operator, cluster, tmp_path):
    """An operator that kept no record (or a Secret gone) leaves a status to restart from, not to carry on."""
    body, job_id = admitted(operator, cluster, tfsnjob())
    old_pod = run_first_attempt(operator, cluster, job_id)
    operator.controller.handlers.checkpoint(job_id, {"step": 40, "path": "/ckpt/step-40"})
    assert operator.writer.write(job_id)
    body = kopf_writes(cluster, body, {"record": None})
    successor = fail_over_to_a_new_operator(operator, tmp_path)
    try:
        assert old_pod not in pods(cluster)  # its agent reports to a job that no longer exists
        [job] = successor.store.jobs()
        assert (job.checkpoint_step, job.checkpoint_path, job.attempt) == (40, "/ckpt/step-40", 1)
        successor.controller.reconcile(job.id)
        [pod] = pods(cluster)
        env = {e["name"]: e.get("value") for e in pods(cluster)[pod]["spec"]["containers"][0]["env"]}
        assert env["TFSN_JOB_ID"] == str(job.id) and env["TFSN_CONTROLLER_URL"] == successor.server.url
        secret = next(iter(objects(cluster, SECRETS).values()))
        assert secret["stringData"]["token"] == job.token  # the new job's token (its nodes' derive from it)
        assert successor.adoption.adopt(on_server(cluster, body)) == {}  # seen again: the same job, nothing new
        assert len(successor.store.jobs()) == 1
    finally:
        successor.close()


# ---- manifests ------------------------------------------------------------------------------------

def _walk(node: dict, path: str = ""):
    yield path, node
    for key in ("properties", "additionalProperties"):
        for name, child in (node.get(key) or {}).items() if key == "properties" else \
                ([("*", node[key])] if isinstance(node.get(key), dict) else []):
            yield from _walk(child, f"{path}.{name}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def test_the_crd_schema_is_structural_and_generated_from_the_job_spec():
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    for path, node in _walk(schema):
        assert "$ref" not in node and "anyOf" not in node and "allOf" not in node, path
        assert node.get("type") or node.get("x-kubernetes-preserve-unknown-fields") or \
            node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties") is not False, path
    # every field of train.yaml is there, and the spec's name is optional (metadata.name stands in)
    assert set(spec["properties"]) == set(JobSpec.model_fields)
    assert spec["required"] == ["run"]
    assert spec["properties"]["recovery"]["properties"]["max_restarts"] == {"minimum": 0, "maximum": 1000,
                                                                           "x-kubernetes-int-or-string": True}
    # forms only the model reads (cpus: 16+, accelerators: H100:8) are left to it, not refused by the API server
    resources = spec["properties"]["resources"]["properties"]
    assert resources["accelerators"] == resources["cpus"] == {"x-kubernetes-preserve-unknown-fields": True}
    status = schema["properties"]["status"]["properties"]
    assert {"phase", "conditions", "nodes", "step", "restarts", "checkpoint", "jobId"} <= set(status)
    columns = {c["name"]: c["jsonPath"] for c in crd.crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns == {"Phase": ".status.phase", "Step": ".status.step", "Restarts": ".status.restarts",
                       "Checkpoint": ".status.checkpoint.step", "Age": ".metadata.creationTimestamp"}


def _as_json_schema(node: dict) -> dict:
    """A structural schema node as the JSON Schema the API server checks a TfsnJob's spec with (draft 4: OpenAPI
    v3.0's boolean exclusiveMinimum); an open node checks nothing, as `x-kubernetes-preserve-unknown-fields`."""
    out = {k: v for k, v in node.items() if k in ("type", "minimum", "maximum", "exclusiveMinimum", "enum",
                                                   "minLength", "maxLength", "pattern", "required")}
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if "properties" in node:
        out["properties"] = {k: _as_json_schema(v) for k, v in node["properties"].items()}
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _as_json_schema(node["additionalProperties"])
    if "items" in node:
        out["items"] = _as_json_schema(node["items"])
    if node.get("nullable") and "type" in out:
        out["type"] = [*([out["type"]] if isinstance(out["type"], str) else out["type"]), "null"]
    return out


# Every field the loader takes as text though its type is a number: `"$40"`, `"2h"`, `"8"` (SkyPilot and dstack
# users quote counts). The CRD said `type: number` or `integer` for most, so the API server refused the TfsnJob.
AS_TEXT = {"num_nodes": "2", "steps": "1e6", "envs": {"SEED": 1, "DEBUG": True, "LR": 0.001},
           "resources": {"accelerators": "H100:8", "max_hourly_cost": "$2.50/hr"},
           "checkpoint": {"dir": "/ckpt", "keep": "3", "interval": "10m"},
           "recovery": {"max_restarts": "3", "spares": "1"},
           "health": {"heartbeat_timeout": "90s", "thresholds": {"phase_timeout_max_s": "2h", "gather_s": "5s"}},
           "model": {"entry": "train.py:build", "entry_timeout": "5m", "params": "1.3B", "layers": "24",
                     "hidden": "2048", "seq_len": "2048", "batch_size": "256"}}
AS_NUMBERS = {"num_nodes": 2, "steps": 10**6, "resources": {"max_hourly_cost": 2.5}, "checkpoint": {"keep": 3,
              "interval": 500}, "recovery": {"max_restarts": 3, "spares": 1}, "health": {"heartbeat_timeout": 90,
              "thresholds": {"phase_timeout_max_s": 7200}}, "model": {"entry_timeout": 300, "params": 1.3e9,
                                                                     "layers": 24, "hidden": 2048, "seq_len": 2048,
                                                                     "batch_size": 256}}


@pytest.mark.parametrize("spec", [AS_TEXT, AS_NUMBERS, {"resources": {"max_hourly_cost": "$40"}}], ids=str)
def test_the_crd_admits_every_form_the_spec_loader_admits(spec):
    jsonschema = pytest.importorskip("jsonschema")
    body = {"run": "python train.py", **spec}
    JobSpec.model_validate({"name": "llm", **body})          # the loader takes it
    schema = _as_json_schema(crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])
    validator = jsonschema.Draft4Validator(schema)
    assert [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(body)] == []
    # and the bounds the schema can say are still said
    assert [e.message for e in validator.iter_errors({**body, "num_nodes": 0})] == ["0 is less than the minimum of 1"]


def test_the_crd_is_accepted_by_the_client_and_served_by_the_emulator(cluster):
    import os

    import kubernetes

    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(os.environ["KUBECONFIG"], client_configuration=configuration)
    api = kubernetes.client.ApiextensionsV1Api(kubernetes.client.ApiClient(configuration))
    made = api.create_custom_resource_definition(crd.crd(), _request_timeout=10)  # the client's own model of it
    assert made.spec.names.kind == crd.KIND and made.spec.versions[0].subresources.status == {}
    listed = api.list_custom_resource_definition(_request_timeout=10).items
    assert [c.metadata.name for c in listed] == ["tfsnjobs.tfsn.dev"]


def test_manifests_command_prints_every_object_to_apply(tmp_path):
    from typer.testing import CliRunner

    from orchestrator.cli.operator import operator_app

    result = CliRunner().invoke(operator_app, ["manifests", "--namespace", "ml-ops", "--checkpoint-claim", "ckpt"])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.output))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                     "Role", "RoleBinding", "Deployment", "Service"]
    role = docs[3]
    assert not any("*" in r["verbs"] or "*" in r["resources"] for r in role["rules"])  # least privilege
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]} in role["rules"]
    # Secrets: only what the code calls (get the token back, create, patch in a new token); never list them
    assert [r["verbs"] for r in role["rules"] if "secrets" in r["resources"]] == [["get", "create", "patch"]]
    assert [r for r in secret_rules(docs) if not {"list", "watch", "update", "delete"}.isdisjoint(r["verbs"])] == []
    ca = next(d for d in docs if d["kind"] == "Role")
    assert (ca["metadata"]["namespace"], ca["rules"][0]) == ("ml-ops", {
        "apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": [crd.CA_SECRET]})
    [container] = docs[7]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TFSN_OPERATOR_ADVERTISE"] == "tfsn-operator.ml-ops.svc"
    assert env["TFSN_OPERATOR_CHECKPOINT_CLAIM"] == "ckpt"
    assert "TFSN_OPERATOR_NAMESPACE" not in env   # every namespace's TfsnJobs
    assert docs[2]["metadata"]["namespace"] == "ml-ops"


def secret_rules(docs: list[dict]) -> list[dict]:
    """Every RBAC rule on Secrets, with the kind and namespace of its role."""
    return [{**rule, "role": (d["kind"], d["metadata"].get("namespace"))} for d in docs
            if d["kind"] in ("Role", "ClusterRole") for rule in d["rules"] if "secrets" in rule["resources"]]


def test_an_operator_for_one_namespace_may_touch_secrets_there_only():
    from typer.testing import CliRunner

    from orchestrator.cli.operator import operator_app

    result = CliRunner().invoke(operator_app, ["manifests", "--namespace", "ml-ops", "--watch-namespace", "team-a"])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.output))
    cluster_role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "nodes", "customresourcedefinitions", "namespaces"}   # nothing of a job's, nothing secret
    for rule in secret_rules(docs):   # the job Secrets in team-a; elsewhere the CA's Secret by its name, or create
        assert rule["role"] == ("Role", "team-a") or rule["verbs"] == ["create"] or \
            rule.get("resourceNames") == [crd.CA_SECRET], rule
    binding = next(d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["namespace"] == "team-a")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": crd.OPERATOR, "namespace": "ml-ops"}]
    [container] = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"]
    assert {"name": "TFSN_OPERATOR_NAMESPACE", "value": "team-a"} in container["env"]
    # which `tfsn operator run` reads as its --namespace
    refused = CliRunner().invoke(operator_app, ["run"], env={"TFSN_OPERATOR_NAMESPACE": "Team_A"})
    assert refused.exit_code == 2 and "--namespace 'Team_A' is not a valid Kubernetes name" in refused.output


def test_manifests_command_refuses_a_bad_namespace_in_one_line():
    from typer.testing import CliRunner

    from orchestrator.cli.operator import operator_app

    result = CliRunner().invoke(operator_app, ["manifests", "--namespace", "ML_Ops"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "--namespace 'ML_Ops'" in result.output and "To fix" in result.output


@pytest.mark.parametrize("args, message", [
    (["--namespace", "Team_A"], "--namespace 'Team_A' is not a valid Kubernetes name"),
    (["--port", "70000"], "--port 70000 is not a TCP port"),
])
def test_run_command_refuses_bad_options_before_starting_anything(args, message):
    from typer.testing import CliRunner

    from orchestrator.cli.operator import operator_app

    result = CliRunner().invoke(operator_app, ["run", *args])
    assert result.exit_code == 2 and message in result.output and result.output.count("\n") == 1


def test_the_example_tfsnjob_is_a_valid_job_spec():
    from pathlib import Path

    docs = yaml.safe_load_all((Path(__file__).parent.parent / "examples" / "k8s" / "tfsnjob.yaml").read_text())
    job = next(d for d in docs if d["kind"] == crd.KIND)
    assert job["apiVersion"] == f"{crd.GROUP}/{crd.VERSION}"
    spec = JobSpec.model_validate({"name": job["metadata"]["name"], **job["spec"]})
    assert spec.checkpoint.dir and spec.checkpoint.dir.startswith("/")


def test_the_shipped_manifests_are_the_generators_output():
    from pathlib import Path

    shipped = Path(__file__).parent.parent / "configs" / "k8s" / "tfsn-operator.yaml"
    assert list(yaml.safe_load_all(shipped.read_text())) == crd.manifests(), (
        "configs/k8s/tfsn-operator.yaml is stale. To fix: regenerate it with `tfsn operator manifests` "
        "(keep its two comment lines)")


# ---- the review of the status store (issue 7): each test fails on the code before its fix ----------

def refuse(cluster, route: str, status: int, reason: str) -> threading.Event:
    """The API server answers `route` ("verb /path") with `status` while the returned flag is set (it is)."""
    refusing = threading.Event()
    refusing.set()
    body = {"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": reason, "code": status,
            "message": f"{reason} (the test's refusal)"}
    cluster.on_loop(lambda k: k[route][lambda: refusing.is_set()] << status << body)
    return refusing


def delay(cluster, route: str, seconds: float) -> None:
    """The API server answers `route` after `seconds` (a loaded API server), serving other requests meanwhile."""
    cluster.on_loop(lambda k: k[route] << (lambda: asyncio.sleep(seconds)))


def running_job(op: Operator, cluster, name: str, uid: str, host: str = "gpu-a", **spec) -> tuple[dict, int, str]:
    """A TfsnJob admitted and running on one pod, its status written: (body, job id, pod)."""
    body = tfsnjob(name, uid=uid, **spec)
    cluster.on_loop(lambda k: k.objects.__setitem__((TFSNJOBS, NAMESPACE, name), body))
    kopf_writes(cluster, body, op.admit(body))
    [job_id] = job_ids(op, body)
    before = set(pods(cluster))
    op.controller.reconcile(job_id)
    [pod] = set(pods(cluster)) - before
    schedule(cluster, pod, host)
    [node] = op.store.nodes(job_id, active_only=True)
    op.controller.handlers.heartbeat(job_id, node.id, {"state": "ready", "host": host})
    op.controller.reconcile(job_id)
    assert op.store.job(job_id).state == JobState.RUNNING
    assert op.writer.write(job_id)
    return on_server(cluster, body), job_id, pod


def delete_secret(op: Operator, name: str) -> None:
    import kubernetes
    kubernetes.client.CoreV1Api(op.provider.api_client()).delete_namespaced_secret(name, NAMESPACE,
                                                                                 _request_timeout=10)


@pytest.mark.parametrize("status, reason", [(503, "ServiceUnavailable"), (403, "Forbidden")])
def test_a_secret_unreadable_just_now_never_restarts_the_job_nor_deletes_its_pod(operator, cluster, tmp_path,
                                                                                 monkeypatch, status, reason):
    """Finding 1: only a Secret really absent (404) means the job cannot be carried on."""
    monkeypatch.setattr("providers.kubernetes.BACKOFF_S", 0.01)
    body, job_id, pod = running_job(operator, cluster, "llm", "1b4e28ba-2fa1-11d2-883f-0016d3cca427")
    refusing = refuse(cluster, f"get /api/v1/namespaces/{NAMESPACE}/secrets/llm-tfsn-token", status, reason)
    successor = fail_over_to_a_new_operator(operator, tmp_path)
    try:
        assert successor.store.jobs() == [] and set(pods(cluster)) == {pod}   # left to the resume handler
        memo = kopf.Memo(tfsn=successor)
        with pytest.raises(kopf.TemporaryError, match=str(status)):          # which kopf runs again later
            k8s_operator.resume(body=on_server(cluster, body), patch=kopf.Patch(), memo=memo)
        assert successor.store.jobs() == [] and set(pods(cluster)) == {pod}
        refusing.clear()
        k8s_operator.resume(body=on_server(cluster, body), patch=kopf.Patch(), memo=memo)
        [job] = successor.store.jobs()
        assert (job.id, job.state, job.attempt) == (job_id, JobState.RUNNING, 1) and set(pods(cluster)) == {pod}
    finally:
        successor.close()


def test_a_status_written_by_a_newer_operator_is_carried_on_by_an_older_one(operator, cluster, tmp_path):
    """Finding 1: fields this operator does not know (a rollback) are ignored, never a reason to restart."""
    body, job_id, pod = running_job(operator, cluster, "llm", "1b4e28ba-2fa1-11d2-883f-0016d3cca427")
    status = body["status"]
    kopf_writes(cluster, body, {"nodes": [{**n, "gpuSerial": "1650"} for n in status["nodes"]],
                                "record": {**status["record"], "queue": "research"},
                                "checkpoint": {**status["checkpoint"], "sizeBytes": 10}})
    successor = fail_over_to_a_new_operator(operator, tmp_path)
    try:
        [job] = successor.store.jobs()
        assert (job.id, job.state) == (job_id, JobState.RUNNING) and set(pods(cluster)) == {pod}
    finally:
        successor.close()


def test_a_job_restarted_at_start_never_takes_the_id_a_later_tfsnjob_holds(operator, cluster, tmp_path):
    """Finding 2: b (job 1) runs on; a (job 2, its Secret gone) restarts as a new job above every listed id."""
    a_uid, b_uid = "aaaaaaaa-0000-0000-0000-000000000001", "bbbbbbbb-0000-0000-0000-000000000002"
    for name, uid in (("a", a_uid), ("b", b_uid)):   # listed a first
        cluster.on_loop(lambda k, name=name, uid=uid: k.objects.__setitem__(
            (TFSNJOBS, NAMESPACE, name), tfsnjob(name, uid=uid)))
    b, b_id, b_pod = running_job(operator, cluster, "b", b_uid, host="gpu-b")
    a, a_id, a_pod = running_job(operator, cluster, "a", a_uid)
    assert (b_id, a_id) == (1, 2)
    delete_secret(operator, "a-tfsn-token")
    successor = fail_over_to_a_new_operator(operator, tmp_path)
    try:
        assert successor.store.job(b_id).spec_path.endswith(b_uid) and successor.store.job(b_id).state == \
            JobState.RUNNING
        assert b_pod in pods(cluster) and a_pod not in pods(cluster)
        [restarted] = job_ids(successor, a)
        assert restarted == 3
    finally:
        successor.close()


def test_one_tfsnjob_that_cannot_be_adopted_leaves_the_others_adopted(operator, cluster, tmp_path):
    """Finding 3: an error adopting one TfsnJob is left to its resume handler, not the end of the startup."""
    a, a_id, a_pod = running_job(operator, cluster, "a", "aaaaaaaa-0000-0000-0000-000000000001")
    b, b_id, b_pod = running_job(operator, cluster, "b", "bbbbbbbb-0000-0000-0000-000000000002", host="gpu-b")
    refusing = refuse(cluster, f"patch /api/v1/namespaces/{NAMESPACE}/secrets/a-tfsn-token", 403, "Forbidden")
    successor = fail_over_to_a_new_operator(operator, tmp_path)
    try:
        assert [j.id for j in successor.store.jobs()] == [b_id] and {a_pod, b_pod} <= set(pods(cluster))
        refusing.clear()
        assert successor.adoption.adopt(on_server(cluster, a)) == {}
        assert sorted(j.id for j in successor.store.jobs()) == [a_id, b_id] and {a_pod, b_pod} <= set(pods(cluster))
    finally:
        successor.close()


def test_the_startup_handler_run_again_after_a_failed_listing_builds_one_operator(operator, cluster, tmp_path,
                                                                                  monkeypatch):
    """Findings 2 and 3: a listing that fails is tried again (the handler fails; kopf runs it again), and
    running it again neither builds a second operator (its API on the same port) nor skips the adoption."""
    body, job_id, pod = running_job(operator, cluster, "llm", "1b4e28ba-2fa1-11d2-883f-0016d3cca427")
    operator.close()
    monkeypatch.setattr("orchestrator.k8s.adoption.LIST_BACKOFF_S", 0.01)
    monkeypatch.setenv("TFSN_HOME", str(tmp_path / "replaced"))
    monkeypatch.setenv("TFSN_OPERATOR_HOST", "127.0.0.1")
    monkeypatch.setenv("TFSN_OPERATOR_PORT", str(free_port()))   # fixed, as in the Deployment
    monkeypatch.setenv("TFSN_OPERATOR_ADVERTISE", ADVERTISE)
    monkeypatch.delenv("TFSN_OPERATOR_NAMESPACE", raising=False)
    refusing = refuse(cluster, f"get /apis/{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}", 403, "Forbidden")
    memo, settings = kopf.Memo(), kopf.OperatorSettings()
    settings.peering.clusterwide = True
    try:
        with pytest.raises(kopf.TemporaryError, match="cannot list the TfsnJobs of the cluster"):
            k8s_operator.start(memo=memo, settings=settings)
        first = memo.tfsn
        assert first.store.jobs() == []
        refusing.clear()
        k8s_operator.start(memo=memo, settings=settings)      # kopf's retry
        assert memo.tfsn is first
        [job] = first.store.jobs()
        assert job.id == job_id and set(pods(cluster)) == {pod}
    finally:
        k8s_operator.stop(memo=memo)


def test_a_replacement_pod_made_as_the_job_is_adopted_is_not_taken_for_a_stranger(operator, cluster, tmp_path):
    """Finding 4: strangers are deleted before the running controller can see the job (a slow pod listing)."""
    body, job_id = admitted(operator, cluster, tfsnjob())
    first = run_first_attempt(operator, cluster, job_id)
    schedule(cluster, first, "gpu-a", phase="Failed")
    for _ in range(2):                      # the node failed, its pod deleted, the job recovering
        operator.controller.reconcile(job_id)
    assert operator.writer.write(job_id) and pods(cluster) == {}
    operator.close()
    delay(cluster, f"get /api/v1/namespaces/{NAMESPACE}/pods", 1.0)
    successor = new_operator(tmp_path / "new")
    successor.start(reconcile=True)
    try:
        successor.adoption.adopt_all()
        [replacement] = wait_for("the replacement pod", lambda: list(pods(cluster)))
        time.sleep(1.5)                     # what a stranger sweep still under way would have deleted by now
        assert list(pods(cluster)) == [replacement]
        assert not any(n.state == NodeState.FAILED and n.heartbeat_at is None for n in successor.store.nodes(job_id))
    finally:
        successor.close()


def test_every_taint_becomes_one_event_even_once_the_status_says_tainted(operator, cluster):
    """Finding 5: the writer writes tainted:true long before the timer runs; the taint is queued instead."""
    operator.start(reconcile=False)
    body, job_id = admitted(operator, cluster, tfsnjob())
    first = run_first_attempt(operator, cluster, job_id)
    schedule(cluster, first, "gpu-a", phase="Failed")
    operator.controller.reconcile(job_id)
    [failed] = wait_for("tainted in the status", lambda: [n for n in on_server(cluster, body)["status"]["nodes"]
                                                          if n["tainted"]])
    assert operator.tainted_since(on_server(cluster, body)) == [("gpu-a", failed["failure"])]
    assert operator.tainted_since(on_server(cluster, body)) == []      # once


def test_the_status_stays_small_however_long_the_job_runs(operator, cluster):
    """Finding 6: settled nodes beyond the newest 16 are dropped, never those the controller reads; texts
    and the blocked offers are bounded."""
    body, job_id = admitted(operator, cluster, tfsnjob())
    store = operator.store
    for i in range(60):                     # nodes that ran, failed and were deleted long ago
        store.add_node(f"old-{i:02d}", job_id, 0, "kubernetes")
        store.update_node(f"old-{i:02d}", state=NodeState.TERMINATED, released=1, heartbeat_at=1.0,
                          failure="Traceback " + "x" * 5000)
    store.add_node("never-started", job_id, 0, "kubernetes")   # counts against the start-failure budget
    store.update_node("never-started", state=NodeState.FAILED, released=1, handle={"data": {"pod": "p"}})
    store.add_node("excluded", job_id, 0, "kubernetes")        # its machine stays out of the job
    store.update_node("excluded", state=NodeState.FAILED, released=1, heartbeat_at=1.0, host="gpu-a")
    store.add_node("live", job_id, 0, "kubernetes")
    store.update_job(job_id, health={"excluded": ["excluded"]}, error="E" * 5000,
                     blocked=[{"offer": {"i": i}, "spot": False, "error": "no " * 1000, "scope": "offer"}
                              for i in range(80)])
    assert operator.writer.write(job_id)
    status = on_server(cluster, body)["status"]
    ids = [n["id"] for n in status["nodes"]]
    assert {"never-started", "excluded", "live"} <= set(ids)
    assert [i for i in ids if i.startswith("old-")] == [f"old-{i:02d}" for i in range(44, 60)]
    assert all(len(n["failure"]) <= 300 for n in status["nodes"]) and len(status["message"]) <= 300
    blocked = status["record"]["blocked"]
    assert [b["offer"]["i"] for b in blocked] == list(range(30, 80)) and all(len(b["error"]) <= 300 for b in blocked)
    assert len(json.dumps(status)) < 64_000


def test_the_timer_and_the_delete_handler_never_wait_on_a_stuck_status_write(operator, cluster, monkeypatch):
    """Finding 7: a status write held up by the API server holds up neither the timer nor a deletion."""
    monkeypatch.setattr("orchestrator.k8s.runtime.FINAL_WRITE_WAIT_S", 0.2)
    body, job_id = admitted(operator, cluster, tfsnjob())
    stuck = threading.Event()

    async def held():
        while not stuck.is_set():
            await asyncio.sleep(0.02)
    cluster.on_loop(lambda k: k[f"patch /apis/{crd.GROUP}/{crd.VERSION}/namespaces/{NAMESPACE}/{crd.PLURAL}/llm/"
                                "status"] << held)
    operator.start(reconcile=False)
    try:
        operator.store.update_job(job_id, step=5)          # the writer's thread is stuck writing it
        operator.store.request_stop(job_id)
        operator.controller.reconcile(job_id)
        assert operator.store.job(job_id).state == JobState.STOPPED
        done = threading.Event()

        def timer_then_delete():
            operator.sync(on_server(cluster, body))
            assert operator.release(on_server(cluster, body))
            done.set()
        threading.Thread(target=timer_then_delete, daemon=True).start()
        assert done.wait(WAIT_S)
    finally:
        stuck.set()


def test_an_operator_restarted_with_its_store_keeps_the_taints_it_made_and_never_retaints(operator, cluster,
                                                                                          tmp_path):
    """Finding 8: a container restart keeps the store, not the memory of which hosts were tainted: an
    admin's repair of the host must not be undone."""
    body, job_id = admitted(operator, cluster, tfsnjob())
    first = run_first_attempt(operator, cluster, job_id)
    schedule(cluster, first, "gpu-a", phase="Failed")
    operator.controller.reconcile(job_id)                  # fails the node and taints gpu-a
    assert operator.writer.write(job_id)
    operator.close()
    cluster.on_loop(lambda k: k.objects[NODES, None, "gpu-a"].patch({"spec": {"taints": []}}))  # repaired
    restarted = new_operator(tmp_path / "operator")        # the same home
    try:
        assert restarted.adoption.adopt(on_server(cluster, body)) == {}
        status = synced(restarted, cluster, body)["status"]
        assert not cluster.on_loop(lambda k: dict(k.objects[NODES, None, "gpu-a"].raw))["spec"]["taints"]
        assert next(n for n in status["nodes"] if n["pod"] == first)["tainted"]
    finally:
        restarted.close()


def test_an_adopted_node_keeps_when_it_last_changed(operator, cluster, tmp_path):
    """Finding 9: the controller tells a node failed in this attempt from older ones by its updated_at."""
    body, job_id = admitted(operator, cluster, tfsnjob(num_nodes=2))
    operator.controller.reconcile(job_id)
    changed = {n.id: n.updated_at for n in operator.store.nodes(job_id)}
    assert operator.writer.write(job_id)
    successor = fail_over_to_a_new_operator(operator, tmp_path)
    try:
        assert {n.id: n.updated_at for n in successor.store.nodes(job_id)} == pytest.approx(changed)
        assert all(n.updated_at > n.created_at for n in successor.store.nodes(job_id))
    finally:
        successor.close()


def test_the_status_writer_outlives_a_broken_write_and_flushes_what_is_due_as_it_stops(operator, cluster):
    """Finding 10: an error outside the API call (the store, the client's set-up) is retried, not fatal."""
    body, job_id = admitted(operator, cluster, tfsnjob())
    failures = [sqlite3.OperationalError("database is locked")]

    def record_of(job_id: int):
        if failures:
            raise failures.pop()
        return operator._record_of(job_id)
    writer = StatusWriter(record_of, operator.custom_objects)
    writer.start()
    operator.store.update_job(job_id, step=7)
    writer.changed(job_id)
    wait_for("the status written after the failure", lambda: on_server(cluster, body)["status"]["step"] == 7)
    operator.store.update_job(job_id, step=9)
    writer.changed(job_id)
    writer.stop()
    assert on_server(cluster, body)["status"]["step"] == 9


def test_a_namespaced_kopf_without_the_namespace_refuses_to_start_and_with_it_adopts_only_there(
        operator, cluster, tmp_path, monkeypatch):
    """Finding 11: kopf does not tell which namespaces it watches; adopting the whole cluster's TfsnJobs
    would take other operators' jobs."""
    body, job_id, pod = running_job(operator, cluster, "llm", "1b4e28ba-2fa1-11d2-883f-0016d3cca427")
    elsewhere = {**body, "metadata": {**body["metadata"], "namespace": "team-b", "uid": "cccccccc-0000-0000-0000-3"}}
    cluster.on_loop(lambda k: k.objects.__setitem__((TFSNJOBS, "team-b", "llm"), elsewhere))
    operator.close()
    monkeypatch.setenv("TFSN_HOME", str(tmp_path / "replaced"))
    monkeypatch.setenv("TFSN_OPERATOR_HOST", "127.0.0.1")
    monkeypatch.setenv("TFSN_OPERATOR_ADVERTISE", ADVERTISE)
    monkeypatch.delenv("TFSN_OPERATOR_NAMESPACE", raising=False)
    memo, settings = kopf.Memo(), kopf.OperatorSettings()
    settings.peering.clusterwide = False              # kopf run --namespace ml
    with pytest.raises(kopf.PermanentError, match="To fix: set TFSN_OPERATOR_NAMESPACE"):
        k8s_operator.start(memo=memo, settings=settings)
    assert getattr(memo, "tfsn", None) is None
    monkeypatch.setenv("TFSN_OPERATOR_NAMESPACE", NAMESPACE)
    try:
        k8s_operator.start(memo=memo, settings=settings)
        [job] = memo.tfsn.store.jobs()
        assert job.spec_path.startswith(f"tfsnjob://{NAMESPACE}/") and job.id == job_id
    finally:
        k8s_operator.stop(memo=memo)


def test_a_restart_runs_the_spec_the_job_ran_with_and_a_bad_spec_deletes_no_pod(operator, cluster, tmp_path):
    """Finding 12: an edited spec is not applied by a restart; nor are pods deleted for a job that cannot start."""
    body, job_id, pod = running_job(operator, cluster, "llm", "1b4e28ba-2fa1-11d2-883f-0016d3cca427")
    cluster.on_loop(lambda k: k.objects[TFSNJOBS, NAMESPACE, "llm"].patch({"spec": {"run": "python edited.py"}}))
    delete_secret(operator, "llm-tfsn-token")
    successor = fail_over_to_a_new_operator(operator, tmp_path)
    try:
        [job] = successor.store.jobs()
        assert job.spec["run"] == "python train.py"
        assert job.id > job_id          # a new job, its id above those the TfsnJobs held
    finally:
        successor.close()


def test_a_restart_whose_spec_is_invalid_says_so_and_keeps_the_pods(operator, cluster, tmp_path):
    body, job_id, pod = running_job(operator, cluster, "llm", "1b4e28ba-2fa1-11d2-883f-0016d3cca427")
    kopf_writes(cluster, body, {"record": None})            # an older operator's status: the spec is the TfsnJob's
    cluster.on_loop(lambda k: k.objects[TFSNJOBS, NAMESPACE, "llm"].patch({"spec": {"num_nodes": 0}}))
    operator.close()
    successor = new_operator(tmp_path / "new")
    try:
        status = successor.adoption.adopt(on_server(cluster, body))
        [valid] = status["conditions"]
        assert (valid["type"], valid["status"]) == ("Valid", "False") and "spec.num_nodes" in valid["message"]
        assert set(pods(cluster)) == {pod} and successor.store.jobs() == []
    finally:
        successor.close()


def test_the_create_handler_for_a_tfsnjob_admitted_by_a_dead_operator_adopts_it(operator, cluster, tmp_path):
    """kopf runs create (not resume) for a TfsnJob whose create it never recorded: the operator died after it
    admitted the job. The new operator carries the job on instead of failing the handler for ever."""
    body, job_id = admitted(operator, cluster, tfsnjob())
    run_first_attempt(operator, cluster, job_id)
    assert operator.writer.write(job_id)
    operator.close()
    successor = new_operator(tmp_path / "new-operator")
    successor.start(reconcile=False)
    try:
        assert successor.admit(on_server(cluster, body)) == {}
        assert [j.id for j in successor.store.jobs()] == [job_id]
    finally:
        successor.close()
