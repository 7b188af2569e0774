"""Workers keep the memory a step frees (orchestrator/control/handlers.WORKER_MALLOC_ENV): glibc's default hands
freed activations back to the kernel and the next step faults them in again, page by page."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys

import pytest

from orchestrator.control.controller import Controller
from orchestrator.control.handlers import WORKER_MALLOC_ENV
from orchestrator.control.store import JobState, NodeState, Store
from orchestrator.spec import JobSpec

# A step's pattern of activations: a few blocks of 3 MiB made, used and freed together, as a convnet's are.
# The page faults of the last steps (the first ones map the memory whatever the settings).
STEPS_CHILD = r"""
import json, resource
import torch
torch.set_num_threads(1)
faults = []
for step in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    acts = [torch.ones(768 * 1024) for _ in range(4)]
    loss = sum(float(a.sum()) for a in acts)
    del acts
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults[4:]))
"""


def _step_faults(env: dict[str, str]) -> list[int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", STEPS_CHILD], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's malloc's")
def test_a_worker_with_the_settings_faults_in_no_memory_at_each_step():
    # glibc's own start (blocks above 128 KiB mapped and unmapped each time): 12 MiB faulted in every step. Its
    # default raises that threshold as blocks are freed, so whether a given process faults depends on its heap's
    # layout (under `tfsn launch`, a convnet's workers did); with the settings no step does.
    unmapped = _step_faults({"MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    kept = _step_faults(WORKER_MALLOC_ENV)
    assert statistics.median(unmapped) > 3000, unmapped
    assert statistics.median(kept) == 0 and sum(kept) <= 1024, kept     # at most a block's growth of the heap


def _command_env(tmp_path, envs: dict[str, str], resources: dict | None = None) -> dict[str, str]:
    tmp_path.mkdir()
    store = Store(tmp_path / "tfsn.db")
    spec = JobSpec.model_validate({"name": "t", "run": "python train.py", "envs": envs,
                                   "resources": resources or {}}).model_dump(mode="json")
    job = store.create_job("t", spec, "p", "the-secret")
    store.add_node("n0", job.id, 0, "local", offer=None, spot=False)
    store.update_node("n0", state=NodeState.READY, handle={"provider": "local", "node_id": "n0", "data": {}})
    store.transition(job.id, JobState.PROVISIONING)
    store.transition(job.id, JobState.RUNNING, "", attempt=1, attempt_state="running", master_port=29500)
    handlers = Controller(store, tmp_path, providers={}).handlers
    return handlers.attempt(job.id, "n0", {"attempt": 1})["env"]


def test_the_workers_get_the_settings_and_a_jobs_envs_override_them(tmp_path):
    env = _command_env(tmp_path / "a", {})
    assert {k: env[k] for k in WORKER_MALLOC_ENV} == WORKER_MALLOC_ENV
    env = _command_env(tmp_path / "b", {"MALLOC_TRIM_THRESHOLD_": "0"})
    assert env["MALLOC_TRIM_THRESHOLD_"] == "0"
    assert env["MALLOC_MMAP_THRESHOLD_"] == WORKER_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's malloc's")
def test_an_empty_value_in_a_jobs_envs_leaves_glibc_its_own_setting(tmp_path):
    # glibc reads an empty MALLOC_MMAP_THRESHOLD_ as 0: every block mapped and unmapped, 3k faults a step. An
    # empty value is how a job says "not tfsn's": no other value gives back glibc's own (a threshold that grows)
    assert statistics.median(_step_faults({"MALLOC_MMAP_THRESHOLD_": ""})) > 3000
    env = _command_env(tmp_path / "a", {"MALLOC_MMAP_THRESHOLD_": "", "MALLOC_TRIM_THRESHOLD_": ""})
    assert not set(WORKER_MALLOC_ENV) & set(env)
    env = _command_env(tmp_path / "b", {"MALLOC_MMAP_THRESHOLD_": "", "SEED": ""})
    assert env["SEED"] == "" and "MALLOC_MMAP_THRESHOLD_" not in env
    assert env["MALLOC_TRIM_THRESHOLD_"] == WORKER_MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"]


def test_gpu_workers_keep_glibcs_own_settings(tmp_path):
    """A GPU node's activations live on the device; on its heap the settings would only keep memory."""
    env = _command_env(tmp_path / "a", {}, {"accelerators": "H100:8"})
    assert not set(WORKER_MALLOC_ENV) & set(env)
    env = _command_env(tmp_path / "b", {"MALLOC_TRIM_THRESHOLD_": "0"}, {"accelerators": "H100:8"})
    assert env["MALLOC_TRIM_THRESHOLD_"] == "0" and "MALLOC_MMAP_THRESHOLD_" not in env
