"""Controller pieces that need no running job."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from orchestrator.control.api import ApiServer
from orchestrator.control.artifacts import Artifacts
from orchestrator.control.calls import DeadlineError, ProviderCalls
from orchestrator.control.controller import Controller
from orchestrator.control.recovery import failure_signature
from orchestrator.spec import JobSpec
from orchestrator.control.store import JobState, NodeState, Result, Store
from providers.base import NodeHandle, NodeRequest, Offer
from providers.local import NODE_TAG, LocalProvider, tagged_pids
from tests.test_failover import URL, ScriptedProvider, h100, submit


def test_a_node_recorded_but_unconfirmed_before_a_crash_is_not_leaked(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    spec = JobSpec.model_validate({"name": "j", "run": "true"}).model_dump(mode="json")
    job = store.create_job("j", spec, "p", "t")
    store.transition(job.id, JobState.PROVISIONING)
    store.add_node("j-1-n0-leak", job.id, 0, "local")
    # the provider started the node, then the controller died before writing the handle down
    leaked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                              env={NODE_TAG: "j-1-n0-leak"}, start_new_session=True)
    deadline = time.monotonic() + 10
    while not tagged_pids("j-1-n0-leak") and time.monotonic() < deadline:
        time.sleep(0.05)

    Controller(store, tmp_path, {"local": LocalProvider()}).nodes.reconcile_intents()  # what a new controller does

    assert leaked.wait(timeout=10) != 0
    assert tagged_pids("j-1-n0-leak") == []
    assert store.node("j-1-n0-leak").state == NodeState.TERMINATED


# ---- issue 17: "the same error twice with no progress" sees through what differs from run to run ----

SAME = [
    ("2026-12-04 07:09:52,123 ERROR loader died", "2026-12-04 07:21:07,481 ERROR loader died"),
    ("CUDA out of memory. 3.44 MiB is free. Process 812 has 79.1 GiB in use",
     "CUDA out of memory. 5.12 MiB is free. Process 977 has 79.3 GiB in use"),
    ("TimeoutError: the barrier timed out after 30.12s", "TimeoutError: the barrier timed out after 30.47s"),
    ("FileNotFoundError: run-7f3a/shard.bin", "FileNotFoundError: run-9c21/shard.bin"),
    ("OSError: [Errno 28] No space left on device: '/tmp/tmpa8f3k2xq/ckpt/step_40.pt'",
     "OSError: [Errno 28] No space left on device: '/tmp/tmpzz81kd0a/ckpt/step_40.pt'"),
    ("[rank3]: RuntimeError: connect() to 10.0.0.5:29500 failed: Connection refused",
     "[rank0]: [rank0]: RuntimeError: connect() to 10.0.0.7:29511 failed: Connection refused"),
    ("ChildFailedError: exitcode 1 (pid: 26453) on [fe80::1]:29500",
     "ChildFailedError: exitcode 1 (pid: 812) on [::1]:41000"),
    ("TypeError: <Loader object at 0x7f3a12bc4d50> is not callable",
     "TypeError: <Loader object at 0x7f99aa0011> is not callable"),
    ("upload of s3://ckpt/run/part failed (request id 8F2A1C3D9E7B6A5F, trace 3f2a9c1e-7b4d-4e21-9a0f-1c2d3e4f5a6b)",
     "upload of s3://ckpt/run/part failed (request id 1A2B3C4D5E6F7A8B, trace 00000000-1111-2222-3333-444444444444)"),
    ("Address already in use: localhost:29500 (process 4242)", "Address already in use: localhost:31337 (process 99)"),
    ("PermissionError: /var/folders/xy/T/tmp_k3j2/lock", "PermissionError: /var/folders/ab/T/tmp_zz91/lock"),
]
DIFFERENT = [
    ("ValueError: loss is NaN", "KeyError: 'model.layer1.weight'"),
    ("OSError: [Errno 28] No space left on device: '/tmp/tmpa8f3k2xq/ckpt.pt'",
     "OSError: [Errno 13] Permission denied: '/tmp/tmpa8f3k2xq/ckpt.pt'"),
    ("FileNotFoundError: /data/train.bin", "FileNotFoundError: /data/valid.bin"),
    ("FileNotFoundError: /data/tmp/a.bin", "FileNotFoundError: /data/tmp/b.bin"),
    ("worker exited with code 1", "worker exited with code 2"),
    ("RuntimeError: shape mismatch: [8, 512] vs [8, 768]", "RuntimeError: shape mismatch: [8, 512] vs [8, 1024]"),
]


@pytest.mark.parametrize("first, second", SAME)
def test_the_same_failure_with_other_temp_names_addresses_and_ids_has_one_signature(first, second):
    assert failure_signature(first) == failure_signature(second)


@pytest.mark.parametrize("first, second", DIFFERENT)
def test_genuinely_different_failures_keep_different_signatures(first, second):
    assert failure_signature(first) != failure_signature(second)


def _fail_attempt(controller: Controller, job_id: int, summary: str) -> None:
    """Attempt N of the job ends with `summary` on its only rank; the controller decides what next."""
    job = controller.store.job(job_id)
    result = Result("n0", job.attempt, 1, None, False, summary, time.time())
    controller.recovery.recover(job, JobSpec.model_validate(job.spec), {}, [result])


def test_the_same_storage_error_twice_with_other_temp_names_and_no_progress_fails_the_job(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {})
    job = store.create_job("j", JobSpec.model_validate({"name": "j", "run": "true"}).model_dump(mode="json"), "p", "t")
    store.transition(job.id, JobState.PROVISIONING)
    store.transition(job.id, JobState.RUNNING)
    _fail_attempt(controller, job.id, "OSError: No space left on device: '/tmp/tmpa8f3k2xq/ckpt.pt'")
    assert store.job(job.id).state == JobState.RECOVERING
    store.transition(job.id, JobState.RUNNING)
    _fail_attempt(controller, job.id, "OSError: No space left on device: '/tmp/tmp0pq7wz1m/ckpt.pt'")
    assert store.job(job.id).state == JobState.FAILED
    assert "failed the same way twice" in store.job(job.id).error


@pytest.mark.parametrize("last_step, checkpoint, note", [
    (2, 4, " at step 4 of 8 (the workers exited with code 0 before `steps`; their last lines are in `tfsn logs`)"),
    (7, 8, ""),        # every step done
    (None, None, ""),  # a script without the SDK reports no step
])
def test_workers_that_exit_0_before_the_specs_steps_succeed_with_a_note(tmp_path, last_step, checkpoint, note):
    """A script that called sys.exit(0) at step 4 of 8 ended 'SUCCEEDED: all 1 node(s) finished', as a finished
    run does: nothing said the training stopped halfway."""
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {})
    spec = JobSpec.model_validate({"name": "j", "run": "true", "steps": 8})
    job = store.create_job("j", spec.model_dump(mode="json"), "p", "t")
    store.transition(job.id, JobState.PROVISIONING)
    store.transition(job.id, JobState.RUNNING, attempt=1, attempt_state="running")
    store.add_node("j-1-n0", job.id, 0, "local")
    store.update_node("j-1-n0", state=NodeState.READY)
    if last_step is not None:
        store.record_steps(job.id, 1, 0, [{"step": last_step, "at": time.time(), "step_time": 0.1}])
        store.update_job(job.id, checkpoint_step=checkpoint)
    store.record_result(job.id, "j-1-n0", 1, 0, None, False, "")
    controller.recovery.watch_attempt(store.job(job.id), spec)
    assert store.job(job.id).state == JobState.SUCCEEDED
    assert store.events(job.id)[-1].message == "SUCCEEDED: all 1 node(s) finished" + note


def test_an_attempt_failed_for_a_hang_restarts_saying_what_was_found(tmp_path):
    """A deadlock ended the attempt and the restart said 'RECOVERING: restart 1 of 1 from the checkpoint at step 6:
    no single node to blame: fail the attempt so that it restarts from the last checkpoint', the policy's action
    in place of the cause; `tfsn launch` ended its line with it too."""
    from health.findings import Action, Decision, Finding, FindingKind, Severity
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {})
    spec = JobSpec.model_validate({"name": "j", "run": "true", "recovery": {"max_restarts": 1}})
    job = store.create_job("j", spec.model_dump(mode="json"), "p", "t")
    store.transition(job.id, JobState.PROVISIONING)
    store.transition(job.id, JobState.RUNNING, attempt=1, attempt_state="running")
    evidence = "no rank finished a step for 10s (timeout 10s) after step 4; every rank still heartbeats"
    hang = Finding(FindingKind.HANG, Severity.CRITICAL, "", None, (0, 1), evidence, time.time(), 4)
    controller.health._apply(store.job(job.id), None, Decision(Action.FAIL, "", hang, "no single node to blame"),
                             {}, time.time())
    controller.recovery.recover(store.job(job.id), spec, {}, [])
    assert store.job(job.id).state == JobState.RECOVERING
    assert store.events(job.id)[-1].message == ("RECOVERING: restart 1 of 1 from the newest valid checkpoint (none "
                                                f"reported yet): hang: {evidence}")


def test_a_restart_does_not_claim_the_last_reported_checkpoint_is_the_one_restored(tmp_path):
    """A worker killed at step 5 had committed step 4 but not yet reported it: the restart said 'from the checkpoint
    at step 2' and the workers then restored step 4. The newest valid checkpoint is what they restore."""
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {})
    job = store.create_job("j", JobSpec.model_validate({"name": "j", "run": "true"}).model_dump(mode="json"), "p", "t")
    store.transition(job.id, JobState.PROVISIONING)
    store.transition(job.id, JobState.RUNNING, checkpoint_step=2)
    _fail_attempt(controller, job.id, "workers exited with code 7")
    assert store.events(job.id)[-1].message == ("RECOVERING: restart 1 of 3 from the newest valid checkpoint (last "
                                                "reported: step 2): workers exited with code 7")


PEER_LOST = "[rank0]: RuntimeError: [pair.cc:537] Read error [127.0.0.1]:31653: Connection reset by peer"


def two_ranks_ending_attempt_1(tmp_path, recovery: dict) -> tuple:
    """A 2-node job whose attempt 1 is stopping, both nodes READY: (store, controller, spec, job)."""
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {})
    spec = JobSpec.model_validate({"name": "j", "run": "true", "num_nodes": 2, "recovery": recovery})
    job = store.create_job("j", spec.model_dump(mode="json"), "p", "t")
    store.transition(job.id, JobState.PROVISIONING)
    store.transition(job.id, JobState.RUNNING, attempt=1, attempt_state="stopping")
    for rank in (0, 1):
        store.add_node(f"j-1-n{rank}", job.id, rank, "local")
        store.update_node(f"j-1-n{rank}", state=NodeState.READY)
    return store, controller, spec, job


@pytest.mark.parametrize("max_restarts, said", [
    (3, "RECOVERING: restart 1 of 3 from the newest valid checkpoint (none reported yet): a worker was killed by "
        "SIGKILL"),
    (0, "FAILED: gave up after 0 restart(s) (recovery.max_restarts); last failure: a worker was killed by SIGKILL"),
])
def test_a_killed_rank_is_the_failure_said_not_its_peers_lost_connection(tmp_path, max_restarts, said):
    """Rank 1's worker was SIGKILLed; rank 0's, in an all-reduce with it, failed on 'Connection reset by peer' and
    its report came first: the restart (and a job that gave up, in its error) named rank 0's lost connection as the
    failure, while the node blamed and replaced was rank 1's."""
    store, controller, spec, job = two_ranks_ending_attempt_1(tmp_path, {"max_restarts": max_restarts})
    results = [Result("j-1-n0", 1, 1, None, False, PEER_LOST, time.time()),
               Result("j-1-n1", 1, 1, 9, False, "a worker was killed by SIGKILL", time.time())]
    controller.recovery.recover(store.job(job.id), spec, {n.id: n for n in store.nodes(job.id)}, results)
    assert store.node("j-1-n1").state == NodeState.FAILED and store.node("j-1-n0").state != NodeState.FAILED
    assert [e.message for e in store.events(job.id) if e.message.startswith(said.split(":")[0])] == [said]


def test_a_rank_that_exited_0_early_is_said_before_its_peers_lost_connection(tmp_path):
    """Rank 1's script returned (exit code 0) at step 10 of 30 while rank 0 trained on: rank 0's next all-reduce
    failed on 'Connection reset by peer', and that was all the restart said, nothing of rank 1's early exit, which
    a user then reads as a network fault; after a second time the job failed with that error alone."""
    store, controller, spec, job = two_ranks_ending_attempt_1(tmp_path, {})
    results = [Result("j-1-n1", 1, 0, None, False, "", time.time()),
               Result("j-1-n0", 1, 1, None, False, PEER_LOST, time.time())]
    controller.recovery.recover(store.job(job.id), spec, {n.id: n for n in store.nodes(job.id)}, results)
    assert store.events(job.id)[-1].message == (
        "RECOVERING: restart 1 of 3 from the newest valid checkpoint (none reported yet): node j-1-n1 (rank 1) "
        f"exited with code 0 while the other ranks still ran; then {PEER_LOST}")


# ---- issue 16: the loop never waits on a cloud ----

def _ended(calls: ProviderCalls, timeout_s: float = 10.0) -> None:
    """Wait until no call is queued or running, collecting as they end."""
    assert calls.settle(timeout_s), "provider calls did not end"


def test_a_call_is_folded_in_on_the_loops_thread_at_its_next_pass_and_never_issued_twice(tmp_path):
    calls = ProviderCalls(threading.Event())
    gate, ran, seen = threading.Event(), [], []
    run = lambda: (ran.append(threading.current_thread().name), gate.wait(10), "handle")[-1]  # noqa: E731
    assert calls.start(("change", "n0"), "aws", "create of n0", run, 10.0, seen.append)
    assert not calls.start(("change", "n0"), "aws", "terminate of n0", run, 10.0, seen.append), "in flight: not again"
    calls.collect()
    assert seen == [] and calls.busy(("change", "n0"))
    gate.set()
    _ended(calls)
    [call] = seen
    assert call.value == "handle" and call.error is None and ran[0].startswith("tfsn-aws-")
    assert ran != [threading.current_thread().name] and not calls.busy(("change", "n0"))


def test_a_call_past_its_deadline_is_a_designed_error_and_keeps_its_key_until_its_thread_returns():
    wake = threading.Event()
    calls = ProviderCalls(wake, lane_threads=1)
    gate, seen, ran = threading.Event(), [], []
    assert calls.start("hung", "gcp", "gcp: create of n0", lambda: gate.wait(30), 0.2, seen.append)
    assert calls.start("queued", "gcp", "gcp: create of n1", lambda: ran.append(1), 0.2, seen.append)
    time.sleep(0.3)
    calls.collect()
    assert {c.key for c in seen} == {"hung", "queued"}
    assert all(isinstance(c.error, DeadlineError) and c.error.scope == "offer" and "0.2s" in str(c.error)
               for c in seen)
    assert calls.busy("hung") and not calls.busy("queued") and calls.in_flight() == 0
    gate.set()
    deadline = time.monotonic() + 10
    while calls.busy("hung") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not calls.busy("hung"), "the key is free once the hung call returned"
    time.sleep(0.2)
    assert ran == [], "a call that met its deadline while queued never runs"
    calls.collect()
    assert len(seen) == 2, "a late result is dropped, not handed over twice"


def test_hung_calls_hold_no_more_threads_than_their_lane_has_and_other_lanes_go_on():
    calls = ProviderCalls(threading.Event(), lane_threads=3)
    gate, seen = threading.Event(), []
    for n in range(12):
        calls.start(("create", n), "azure", f"azure: create of n{n}", lambda: gate.wait(30), 60.0, seen.append)
    assert calls.start("status", "local", "local: status of n0", lambda: "running", 60.0, seen.append)
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        calls.collect()
        time.sleep(0.02)
    assert [c.value for c in seen] == ["running"], "another provider's call is not stuck behind azure's"
    lanes = [t for t in threading.enumerate() if t.name.startswith("tfsn-azure-")]
    assert len(lanes) == 3 and all(t.daemon for t in lanes)
    gate.set()
    _ended(calls)
    assert len(seen) == 13


class HangingCloud(ScriptedProvider):
    """A cloud whose creates in `hang_zones` do not answer until `release` is set (or for 10 minutes)."""

    shares_host = True           # its nodes never reach the API: only the hung call matters here
    create_deadline_s = 3.0

    def __init__(self, offers: list[Offer], hang_zones: set[str]) -> None:
        super().__init__("aws", offers)
        self.hang_zones = hang_zones
        self.release = threading.Event()
        self.entered: list[str] = []

    def provision(self, request: NodeRequest) -> NodeHandle:
        self.entered.append(request.node_id)
        if request.offer.zone in self.hang_zones:
            self.release.wait(600)
        return super().provision(request)


def _wait(what: str, check, timeout_s: float) -> float:
    """Seconds until `check()` held (AssertionError after `timeout_s`)."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - start



def _cloud_and_local_jobs(store: Store, name: str, workdir, tmp_path) -> tuple[int, int]:
    """A job of 8 H100s on aws (`workdir`, a long heartbeat timeout) and a local one that sleeps: their ids."""
    cloud = store.create_job(name, JobSpec.model_validate({
        "name": name, "run": "python train.py", "workdir": str(workdir), "health": {"heartbeat_timeout": "10m"},
        "resources": {"accelerators": "H100:8", "infra": ["aws"]}}).model_dump(mode="json"), "p", "t").id
    local = store.create_job("local", JobSpec.model_validate({
        "name": "local", "run": "sleep 300", "workdir": str(tmp_path)}).model_dump(mode="json"), "p", "t").id
    return cloud, local


def _local_node_death_recovered(store: Store, local: int) -> tuple[float, float]:
    """Kill the running local job's node: seconds until it was failed, then until the job's second attempt ran."""
    [first] = [n for n in store.nodes(local) if n.state == NodeState.READY]
    LocalProvider().terminate(NodeHandle("local", first.id))
    detected = _wait("the dead node to be failed", lambda: store.node(first.id).state == NodeState.FAILED, 10)
    recovered = _wait("the local job's restart",
                      lambda: store.job(local).attempt == 2 and store.job(local).state == JobState.RUNNING, 60)
    return detected, recovered


class VmCloud(ScriptedProvider):
    """A cloud whose nodes boot with the startup script (they need the job's code archive and tfsn's wheel)."""

    runs_boot_script = True
    shares_host = True           # its nodes never reach the API: only the preparation of their files matters here


class SlowArtifacts(Artifacts):
    """The controller's artifacts, whose packing of a job's code waits for `release` (a large workdir)."""

    def __init__(self, home) -> None:
        super().__init__(home)
        self.release = threading.Event()
        self.packing: list[str] = []

    def add_code(self, workdir, plan=()):
        self.packing.append(threading.current_thread().name)
        self.release.wait(60)
        return super().add_code(workdir, plan)


def test_packing_a_jobs_code_runs_off_the_loop_and_delays_no_other_jobs_recovery(tmp_path, monkeypatch):
    """Before: boot_files packed the workdir (and built tfsn's wheel, up to 600 s) on the reconcile loop itself,
    so one large workdir froze failure detection for every job."""
    monkeypatch.setenv("TFSN_INSTALL_SPEC", "tfsn==0.1.0")     # no wheel build: the packing is what waits
    store = Store(tmp_path / "tfsn.db")
    cloud = VmCloud("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    controller = Controller(store, tmp_path, {"local": LocalProvider(), "aws": cloud})
    controller.ctx.artifacts = artifacts = SlowArtifacts(tmp_path)
    server = ApiServer(0, store, controller.handlers)
    controller.listen(server)
    server.start()
    stop = threading.Event()
    loop = threading.Thread(target=controller.run_forever, args=(stop, 600.0), daemon=True)
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")
    vm, local = _cloud_and_local_jobs(store, "vm", code, tmp_path)
    try:
        loop.start()
        _wait("the local job to run", lambda: store.job(local).state == JobState.RUNNING, 60)
        assert artifacts.packing and artifacts.packing[0] != loop.name, "packed in a worker, not on the loop"
        _local_node_death_recovered(store, local)      # the node dies while the packing waits
        assert cloud.requests == [] and store.job(vm).artifacts == {}, "no node before its files are ready"
        artifacts.release.set()
        _wait("the VM's create", lambda: len(cloud.requests) == 1, 30)
        [request] = cloud.requests
        assert request.boot.code_sha256 == store.job(vm).artifacts["code"] and artifacts.path(request.boot.code_sha256)
        assert len(artifacts.packing) == 1, "packed once"
    finally:
        artifacts.release.set()
        stop.set()
        loop.join(15)
        for job_id in (local, vm):
            store.request_stop(job_id)
            controller.reconcile(job_id)
        server.shutdown()
        server.server_close()


def test_a_workdir_that_cannot_be_packed_fails_its_job_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("TFSN_INSTALL_SPEC", "tfsn==0.1.0")
    monkeypatch.setenv("TFSN_CODE_MAX_MB", "0.001")                # a cap of 1 KiB
    store = Store(tmp_path / "tfsn.db")
    cloud = VmCloud("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    controller = Controller(store, tmp_path, {"aws": cloud})
    code = tmp_path / "code"
    code.mkdir()
    (code / "data.bin").write_bytes(b"x" * 4096)
    job = store.create_job("big", JobSpec.model_validate({
        "name": "big", "run": "python train.py", "workdir": str(code),
        "resources": {"accelerators": "H100:8", "infra": ["aws"]}}).model_dump(mode="json"), "p", "t").id
    for _ in range(3):
        controller.reconcile(job)
    failed = store.job(job)
    assert failed.state == JobState.FAILED and "over the cap" in failed.error and "TFSN_CODE_MAX_MB" in failed.error
    assert cloud.requests == []


def test_a_hung_cloud_call_neither_delays_another_jobs_recovery_nor_the_controllers_exit(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    cloud = HangingCloud([h100("aws", "us-east-1", "us-east-1a", 90.0), h100("aws", "us-east-1", "us-east-1b", 95.0)],
                         hang_zones={"us-east-1a"})
    controller = Controller(store, tmp_path, {"local": LocalProvider(), "aws": cloud})
    server = ApiServer(0, store, controller.handlers)
    controller.listen(server)
    server.start()
    stop = threading.Event()
    loop = threading.Thread(target=controller.run_forever, args=(stop, 600.0), daemon=True)
    stuck, local = _cloud_and_local_jobs(store, "stuck", tmp_path, tmp_path)
    try:
        loop.start()
        _wait("the local job to run", lambda: store.job(local).state == JobState.RUNNING, 60)
        assert cloud.release.is_set() is False and len(cloud.entered) >= 1, "the stuck job's create hangs"
        detected, recovered = _local_node_death_recovered(store, local)   # the node dies while the cloud call hangs
        print(f"failure detected in {detected:.1f}s, restarted {recovered:.1f}s later, a create hung meanwhile")
        assert not cloud.release.is_set() and cloud.entered[0] in {n.id for n in store.nodes(stuck)}

        # the hung create met its deadline: its offer failed over, and it was not asked again
        _wait("the stuck job's next zone", lambda: any(n.state == NodeState.STARTING for n in store.nodes(stuck)), 30)
        hung, placed = store.nodes(stuck)
        assert hung.state == NodeState.FAILED and "did not return within 3s" in hung.failure
        assert placed.offer["zone"] == "us-east-1b" and cloud.entered.count(hung.id) == 1
        [block] = store.job(stuck).blocked
        assert (block["offer"]["zone"], block["scope"]) == ("us-east-1a", "offer")

        stop.set()
        exited = _wait("the loop to return", lambda: not loop.is_alive(), 15)
        assert exited < 10 and not cloud.release.is_set(), "the hung call did not hold up the controller's exit"
    finally:
        stop.set()
        loop.join(15)
        for job_id in (local, stuck):
            store.request_stop(job_id)
            controller.reconcile(job_id)
        cloud.release.set()
        server.shutdown()
        server.server_close()
    # once the hung call returned, the node it made is deleted by the id its late answer gave (not leaked)
    def answered() -> bool:   # what the loop's next pass does first
        controller.calls.collect()
        return not controller.calls.busy(("change", hung.id))
    _wait("the hung create's late answer", answered, 10)
    controller.nodes.sweep_releases()
    _ended(controller.calls)
    assert hung.id in cloud.terminated and store.node(hung.id).released
    assert all(n.released for n in store.nodes(local))


HUNG_AT_EXIT = """
import sys, threading, time
from pathlib import Path
from orchestrator.control.controller import Controller
from orchestrator.control.store import Store
from orchestrator.spec import JobSpec
from tests.test_controller import HangingCloud
from tests.test_failover import h100

store = Store(Path(sys.argv[1]) / "tfsn.db")
cloud = HangingCloud([h100("aws", "us-east-1", "us-east-1a", 90.0)], hang_zones={"us-east-1a"})
cloud.create_deadline_s = 3600.0
store.create_job("stuck", JobSpec.model_validate({"name": "stuck", "run": "true", "workdir": sys.argv[1],
    "resources": {"accelerators": "H100:8", "infra": ["aws"]}}).model_dump(mode="json"), "p", "t")
stop = threading.Event()
def stop_once_hung():
    while not cloud.entered:
        time.sleep(0.05)
    stop.set()
threading.Thread(target=stop_once_hung, daemon=True).start()
Controller(store, Path(sys.argv[1]), {"aws": cloud}).run_forever(stop, 600.0)
print("loop returned with the create still hung:", not cloud.release.is_set(), flush=True)
"""


def test_the_controllers_process_exits_while_a_cloud_call_hangs(tmp_path):
    """The call's thread is a daemon: the process does not wait for it (a thread pool's would be joined at exit)."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HUNG_AT_EXIT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "loop returned with the create still hung: True" in proc.stdout
    assert time.monotonic() - started < 60


class BarrierDelete(ScriptedProvider):
    """Deletes that return only once `parties` of them run at the same time."""

    shares_host = True

    def __init__(self, offers: list[Offer], parties: int) -> None:
        super().__init__("aws", offers)
        self.barrier = threading.Barrier(parties, timeout=20)

    def terminate(self, handle: NodeHandle) -> None:
        self.barrier.wait()          # BrokenBarrierError unless every delete of the job runs side by side
        super().terminate(handle)


def test_a_stopped_jobs_nodes_are_deleted_side_by_side(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    cloud = BarrierDelete([h100("aws", "us-east-1", "us-east-1a", 90.0)], parties=4)
    controller = Controller(store, tmp_path, {"aws": cloud})
    job_id = store.create_job("big", JobSpec.model_validate({
        "name": "big", "run": "true", "workdir": str(tmp_path), "num_nodes": 4,
        "resources": {"accelerators": "H100:8", "infra": ["aws"]}}).model_dump(mode="json"), "p", "t").id
    controller.reconcile(job_id)
    assert len(cloud.created) == 4
    stop = threading.Event()
    loop = threading.Thread(target=controller.run_forever, args=(stop, 600.0), daemon=True)
    store.request_stop(job_id)
    loop.start()
    try:
        _wait("every node deleted", lambda: all(n.released for n in store.nodes(job_id)), 30)
    finally:
        stop.set()
        loop.join(15)
    assert sorted(cloud.terminated) == sorted(cloud.created) and store.job(job_id).state == JobState.STOPPED


def test_a_big_jobs_creates_in_flight_are_bounded_and_a_stop_does_not_wait_for_them(tmp_path):
    from orchestrator.control.calls import LANE_THREADS
    from orchestrator.control.provisioning import CREATES_PER_PASS
    store = Store(tmp_path / "tfsn.db")
    cloud = HangingCloud([h100("aws", "us-east-1", "us-east-1a", 90.0)], hang_zones={"us-east-1a"})
    cloud.create_deadline_s = 600.0
    controller = Controller(store, tmp_path, {"aws": cloud})
    job_id = store.create_job("big", JobSpec.model_validate({
        "name": "big", "run": "true", "workdir": str(tmp_path), "num_nodes": 40,
        "resources": {"accelerators": "H100:8", "infra": ["aws"]}}).model_dump(mode="json"), "p", "t").id
    stop = threading.Event()
    loop = threading.Thread(target=controller.run_forever, args=(stop, 600.0), daemon=True)
    loop.start()
    try:
        _wait("the first creates", lambda: len(store.nodes(job_id)) >= CREATES_PER_PASS, 30)
        passes = controller.wake                     # every pass clears it; let a few go by
        for _ in range(4):
            passes.set()
            time.sleep(0.3)
        assert len(store.nodes(job_id)) == CREATES_PER_PASS, "no more creates in flight than CREATES_PER_PASS"
        assert len(cloud.entered) == LANE_THREADS, "the others wait in the provider's lane"
        store.request_stop(job_id)
        controller.wake.set()
        _wait("the stop", lambda: store.job(job_id).state == JobState.STOPPED, 10)
        assert not cloud.release.is_set(), "stopped while every create still hung"
        cloud.release.set()
        _wait("every node made deleted", lambda: all(n.released for n in store.nodes(job_id)), 30)
    finally:
        cloud.release.set()
        stop.set()
        loop.join(15)
    assert sorted(cloud.terminated) == sorted(n.id for n in store.nodes(job_id))
    assert sorted(cloud.created) == sorted(cloud.entered), "the creates still queued at the stop never ran"


class HungDelete(ScriptedProvider):
    """A cloud whose deletes do not answer until `release` is set."""

    shares_host = True
    terminate_deadline_s = 1.0

    def __init__(self, offers: list[Offer]) -> None:
        super().__init__("aws", offers)
        self.release = threading.Event()
        self.deletes: list[str] = []

    def terminate(self, handle: NodeHandle) -> None:
        self.deletes.append(handle.node_id)
        self.release.wait(600)
        super().terminate(handle)


def test_a_hung_delete_does_not_hold_up_the_stop_and_is_tried_again_once_it_returned(tmp_path, monkeypatch):
    import orchestrator.control.nodes as nodes_module
    monkeypatch.setattr(nodes_module, "RELEASE_RETRY_S", 0.0)
    store = Store(tmp_path / "tfsn.db")
    cloud = HungDelete([h100("aws", "us-east-1", "us-east-1a", 90.0)])
    controller = Controller(store, tmp_path, {"aws": cloud})
    job_id = store.create_job("j", JobSpec.model_validate({
        "name": "j", "run": "true", "workdir": str(tmp_path),
        "resources": {"accelerators": "H100:8", "infra": ["aws"]}}).model_dump(mode="json"), "p", "t").id
    controller.reconcile(job_id)
    [node] = store.nodes(job_id)
    stop = threading.Event()
    loop = threading.Thread(target=controller.run_forever, args=(stop, 600.0), daemon=True)
    store.request_stop(job_id)
    loop.start()
    try:
        _wait("the stop", lambda: store.job(job_id).state == JobState.STOPPED, 10)
        _wait("the delete's deadline", lambda: any("could not be terminated yet" in e.message
                                                   for e in store.events(job_id)), 10)
        assert "did not return within 1s" in store.events(job_id)[-1].message
        time.sleep(0.5)
        assert cloud.deletes == [node.id] and not store.node(node.id).released, "not asked again while it hangs"
        cloud.release.set()
        _wait("the node deleted", lambda: store.node(node.id).released, 10)
    finally:
        cloud.release.set()
        stop.set()
        loop.join(15)
    assert cloud.deletes == [node.id, node.id], "asked again once the hung call returned, until confirmed"


def test_a_nodes_request_carries_its_stores_owner_tag(tmp_path):
    """What `tfsn down` tells another store's resources by (test_down): every create names the store it is for."""
    from providers.naming import OWNER_TAG, node_tags
    store = Store(tmp_path / "tfsn.db")
    cloud = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    cloud.shares_host = True   # no API for its nodes to reach: only the request matters here
    controller = Controller(store, tmp_path, {"aws": cloud})
    job_id = store.create_job("j", JobSpec.model_validate({
        "name": "j", "run": "true", "workdir": str(tmp_path),
        "resources": {"accelerators": "H100:8", "infra": ["aws"]}}).model_dump(mode="json"), "p", "t").id
    controller.reconcile(job_id)
    [request] = cloud.requests
    assert len(store.owner) == 12 and request.owner == store.owner
    assert node_tags(request)[OWNER_TAG] == node_tags(request, label_safe=True)[OWNER_TAG] == store.owner


class LaggingSearch(HangingCloud):
    """Like EC2: a machine is known by the id its create returned, and a search by its tag does not see a fresh
    one yet (a terminate that has no id finds nothing, and says it is gone)."""

    def provision(self, request: NodeRequest) -> NodeHandle:
        handle = super().provision(request)
        return NodeHandle(self.name, handle.node_id, {**handle.data, "instance_id": f"i-{request.node_id}"})

    def terminate(self, handle: NodeHandle) -> None:
        if "instance_id" in handle.data:
            super().terminate(handle)


def _loop(controller: Controller) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    loop = threading.Thread(target=controller.run_forever, args=(stop, 600.0), daemon=True)
    loop.start()
    return stop, loop


def _cloud_job(store: Store, tmp_path, name: str = "j") -> int:
    return store.create_job(name, JobSpec.model_validate({
        "name": name, "run": "true", "workdir": str(tmp_path), "health": {"heartbeat_timeout": "10m"},
        "resources": {"accelerators": "H100:8", "infra": ["aws"]}}).model_dump(mode="json"), "p", "t").id


def test_a_create_that_answers_after_its_deadline_is_deleted_by_the_id_it_gave(tmp_path):
    """Before, a late create's answer was dropped and its node deleted by tag: on a cloud whose search lags, the
    machine was marked deleted and left running (billed, with nothing left to find it but `tfsn down`)."""
    store = Store(tmp_path / "tfsn.db")
    cloud = LaggingSearch([h100("aws", "us-east-1", "us-east-1a", 90.0), h100("aws", "us-east-1", "us-east-1b", 95.0)],
                          hang_zones={"us-east-1a"})
    cloud.create_deadline_s = 1.0
    controller = Controller(store, tmp_path, {"aws": cloud})
    job_id = _cloud_job(store, tmp_path)
    stop, loop = _loop(controller)
    try:
        _wait("the next zone", lambda: any(n.state == NodeState.STARTING for n in store.nodes(job_id)), 30)
        hung = store.nodes(job_id)[0]
        assert hung.state == NodeState.FAILED and "did not return within 1s" in hung.failure
        cloud.release.set()   # the cloud answers at last: it made the machine
        _wait("the late node deleted", lambda: store.node(hung.id).released, 10)
    finally:
        cloud.release.set()
        stop.set()
        loop.join(15)
    assert hung.id in cloud.terminated, "marked deleted, yet the machine runs"
    assert store.node(hung.id).handle["data"]["instance_id"] == f"i-{hung.id}"


def test_a_node_released_while_its_create_ran_is_billed_from_its_answer_to_its_deletion(tmp_path):
    """Before, a node stopped while its create ran counted 0 node-hours, though the cloud made it and billed it
    until it was deleted."""
    from orchestrator.control.cost import billed_hours
    store = Store(tmp_path / "tfsn.db")
    cloud = HangingCloud([h100("aws", "us-east-1", "us-east-1a", 90.0)], hang_zones={"us-east-1a"})
    controller = Controller(store, tmp_path, {"aws": cloud})
    job_id = _cloud_job(store, tmp_path)
    stop, loop = _loop(controller)
    try:
        _wait("the create", lambda: bool(cloud.entered), 30)
        store.request_stop(job_id)
        controller.wake.set()
        _wait("the stop", lambda: store.job(job_id).state == JobState.STOPPED, 10)
        cloud.release.set()
        [node] = store.nodes(job_id)
        _wait("the node made, then deleted", lambda: store.node(node.id).released, 10)
    finally:
        cloud.release.set()
        stop.set()
        loop.join(15)
    node = store.node(node.id)
    assert node.id in cloud.terminated and node.provisioned_at is not None
    assert node.provisioned_at <= node.released_at and billed_hours(node, time.time()) > 0


# ---- the controller's own stalls (a suspended laptop, a SIGSTOP, a starved process) are not the nodes' fault ----

class WallClock:
    """`time.time()` standing still but moved forward at will, `time.monotonic()` left alone: what a process sees
    across a suspend (or a SIGSTOP, as far as heartbeat ages go). Every timestamp the controller keeps or compares
    reads it, and no pass's own time blurs what a test measures."""

    def __init__(self, monkeypatch) -> None:
        self.skew = 0.0
        start = time.time()
        monkeypatch.setattr(time, "time", lambda: start + self.skew)

    def advance(self, seconds: float) -> None:
        self.skew += seconds


def _stall_job(tmp_path, monkeypatch, num_nodes: int) -> tuple[WallClock, Store, Controller, int]:
    """A cloud job (heartbeat timeout 30s) reconciled once under a steerable wall clock: the clock, the store, the
    controller and the job's id."""
    clock = WallClock(monkeypatch)
    store = Store(tmp_path / "tfsn.db")
    aws = ScriptedProvider("aws", [h100("aws", "us-east-1", "us-east-1a", 90.0)])
    controller = Controller(store, tmp_path, {"aws": aws, "gcp": ScriptedProvider("gcp", [])}, url=URL)
    job_id = submit(store, tmp_path, num_nodes=num_nodes, health={"heartbeat_timeout": "30s"})
    controller.reconcile(job_id)
    return clock, store, controller, job_id


def _running_pair(tmp_path, monkeypatch) -> tuple[WallClock, Controller, int, str, str]:
    """A two-node cloud job (heartbeat timeout 30s) whose nodes both heartbeat: the clock, the controller, the job's
    id and its two nodes' ids."""
    clock, store, controller, job_id = _stall_job(tmp_path, monkeypatch, 2)
    first, second = store.nodes(job_id)
    for addr, node in enumerate((first, second)):
        controller.handlers.heartbeat(job_id, node.id, {"state": "ready", "addr": f"10.0.1.{addr + 1}"})
    controller.reconcile(job_id)
    assert store.job(job_id).state == JobState.RUNNING
    return clock, controller, job_id, first.id, second.id


def _stall_events(store: Store, job_id: int) -> list[str]:
    return [e.message for e in store.events(job_id) if "controller stalled" in e.message]


def test_a_controller_stall_restarts_the_heartbeat_clocks_and_a_dead_node_is_failed_one_timeout_after(tmp_path,
                                                                                                     monkeypatch):
    """Before: a controller that did not run for longer than the heartbeat timeout (the laptop running `tfsn
    launch` suspended) failed every node at its first pass after it resumed, and the job restarted all of them."""
    clock, controller, job_id, live, dead = _running_pair(tmp_path, monkeypatch)
    store = controller.store
    clock.advance(100)              # suspended for 100 s: the loop did not run, no heartbeat was recorded
    controller.reconcile(job_id)    # the loop's first pass after the resume comes before any heartbeat
    assert [store.node(n).state for n in (live, dead)] == [NodeState.READY] * 2
    assert _stall_events(store, job_id) == ["controller stalled for 100s: heartbeat clocks restarted"]

    waited = 0
    while store.node(dead).state == NodeState.READY and waited < 120:
        clock.advance(5)            # the loop runs on; only the live node's agent speaks again
        waited += 5
        controller.handlers.heartbeat(job_id, live, {"state": "ready"})
        controller.reconcile(job_id)
    assert waited == 35, "a dead node is failed at the first pass past one timeout after the controller resumed"
    assert store.node(dead).failure == "no heartbeat for 135s (35s since the controller ran again after a stall)"
    assert store.node(live).state == NodeState.READY
    assert len(_stall_events(store, job_id)) == 1


def test_a_controller_stall_while_a_node_boots_restarts_its_wait_for_a_first_heartbeat(tmp_path, monkeypatch):
    """The wait for a new node's first heartbeat (its boot) is a heartbeat clock too: a stall during it failed the
    node 'no heartbeat within 30s of start' at the resume; now it waits one timeout more, no longer."""
    clock, store, controller, job_id = _stall_job(tmp_path, monkeypatch, 1)
    (node,) = store.nodes(job_id)
    clock.advance(100)
    controller.reconcile(job_id)
    assert store.node(node.id).state == NodeState.STARTING
    assert _stall_events(store, job_id) == ["controller stalled for 100s: heartbeat clocks restarted"]
    clock.advance(30)
    controller.reconcile(job_id)
    assert store.node(node.id).state == NodeState.STARTING
    clock.advance(1)
    controller.reconcile(job_id)
    assert store.node(node.id).failure == ("no heartbeat within 30s of start (31s since the controller ran again "
                                           "after a stall)")


@pytest.mark.parametrize("gap", [20, 45])
def test_a_controller_that_stalls_again_and_again_pardons_only_the_nodes_it_hears_between_stalls(tmp_path, monkeypatch,
                                                                                                gap):
    """After a first stall of 100 s, each pass comes `gap` seconds after the last (a starved controller): past the
    stall bound (half the 30 s timeout), below and above the timeout. A node heard between two stalls is pardoned
    again; a dead one only once, so it is failed within a timeout (and one gap) of the first stall, however long
    the stalling goes on."""
    clock, controller, job_id, live, dead = _running_pair(tmp_path, monkeypatch)
    store = controller.store
    clock.advance(100)
    controller.reconcile(job_id)
    controller.handlers.heartbeat(job_id, live, {"state": "ready"})   # heard after the loop's pass
    stalled = 0
    while store.node(dead).state == NodeState.READY and stalled < 400:
        clock.advance(gap)
        stalled += gap
        controller.reconcile(job_id)
        controller.handlers.heartbeat(job_id, live, {"state": "ready"})
    assert stalled <= 30 + gap, f"the dead node was pardoned for {stalled}s of stalls after the first"
    for _ in range(10):             # and the live one never
        clock.advance(gap)
        controller.reconcile(job_id)
        controller.handlers.heartbeat(job_id, live, {"state": "ready"})
    assert store.node(live).state == NodeState.READY, store.node(live).failure
    # a stall shorter than the timeout fails no node by itself: said only when it would have
    events = _stall_events(store, job_id)
    assert events[0] == "controller stalled for 100s: heartbeat clocks restarted"
    assert events[1:] == ([] if gap < 30 else [f"controller stalled for {gap}s: heartbeat clocks restarted"]
                          * (stalled // gap + 10))


def _post(controller: Controller, job_id: int, step: int | None) -> None:
    """Every rank of the job posts as the SDK does: step `step` just finished (None: only its heartbeat)."""
    job, now = controller.store.job(job_id), time.time()
    records = [] if step is None else [{"step": step, "at": now, "step_time": 1.0}]
    for rank in range(16):          # two nodes of eight GPUs
        controller.handlers.telemetry(job_id, {"attempt": job.attempt, "rank": rank, "records": records,
                                               "heartbeat": now})


def _hangs(store: Store, job_id: int) -> list[str]:
    return [e.message for e in store.events(job_id) if e.message.startswith("hang")]


@pytest.mark.parametrize("gap", [5, 20])
def test_a_controller_stall_is_no_hang_and_a_real_hang_is_still_found_one_timeout_after(tmp_path, monkeypatch, gap):
    """Before: ranks that trained on while the controller did not run for longer than the hang timeout (120 s)
    were all called hung at its first pass after the resume (no step heard for that long), and the attempt failed.
    After it, ranks that heartbeat but finish no step are hung one hang timeout after the resume, even when the
    controller keeps stalling (every `gap` seconds: 20 s is past the stall bound of the 30 s heartbeat timeout)."""
    clock, controller, job_id, first, second = _running_pair(tmp_path, monkeypatch)
    store = controller.store
    for step in range(20):
        clock.advance(1)
        _post(controller, job_id, step)
        controller.reconcile(job_id)
    clock.advance(200)
    controller.reconcile(job_id)
    assert _hangs(store, job_id) == [] and store.job(job_id).attempt_state == "running"
    assert [store.node(n).state for n in (first, second)] == [NodeState.READY] * 2

    waited = 0
    while not _hangs(store, job_id) and waited < 600:   # the ranks are stuck now: they only heartbeat
        clock.advance(gap)
        waited += gap
        for node in (first, second):
            controller.handlers.heartbeat(job_id, node, {"state": "ready"})
        _post(controller, job_id, None)
        controller.reconcile(job_id)
    assert 120 < waited <= 120 + gap, _hangs(store, job_id)
    assert "every rank still heartbeats" in _hangs(store, job_id)[0]
