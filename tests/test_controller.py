"""Controller pieces that need no running job."""
from __future__ import annotations

import subprocess
import sys
import time

from orchestrator.control.controller import Controller
from orchestrator.spec import JobSpec
from orchestrator.control.store import JobState, NodeState, Store
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
