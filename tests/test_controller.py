"""Controller pieces that need no running job."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from orchestrator.control.controller import Controller
from orchestrator.control.recovery import failure_signature
from orchestrator.spec import JobSpec
from orchestrator.control.store import JobState, NodeState, Result, Store
from providers.local import NODE_TAG, LocalProvider, tagged_pids


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
