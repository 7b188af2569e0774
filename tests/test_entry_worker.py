"""Workers run what `tfsn plan` compiled: the step searched for this machine at plan time is what a worker's
`tfsn.optimize` finds, so it searches nothing, on a local node (which shares the controller's cache) and on a cloud
node whose cache starts empty (the plan's entries travel in the job's code archive and its agent installs them); a
worker on hardware the plan was not searched for searches its own step and says so in its log, and so does one
whose shipped entry is corrupt.

The worker here is the job's own process as the controller starts it on a node (OMP_NUM_THREADS and
TFSN_PLANNED_HARDWARE from the controller's rules, the model wrapped in DDP in a gloo group), one rank.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """\
import json, os, sys
import torch
import torch.distributed as dist
import torch.nn.functional as F

class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)

def build():
    torch.manual_seed(0)
    return Classifier(), (torch.randn(8, 32), torch.randint(4, (8,))), None

if __name__ == "__main__":
    import tfsn
    from optimizer import backend
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    model, batch, _ = build()
    eager = model(*batch)
    loss = tfsn.optimize(DDP(model))(*batch)
    loss.backward()
    print(json.dumps({**backend.STATS, "loss": loss.item(), "eager": eager.item()}))
    dist.destroy_process_group()
"""


def _worker(workdir: Path, env: dict[str, str], name: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "train.py", str(workdir / f"{name}.rendezvous")], cwd=workdir, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _cloud_node(tmp_path: Path, spec, monkeypatch) -> tuple[Path, Path, str]:
    """A cloud node of the job as the controller boots it: the job's plan recorded, its code archive packed (with the
    plan's search entries), unpacked into the node's own workdir, and the agent's install into the node's empty cache
    before the workers start. The node's workdir and cache, and what the agent said."""
    from orchestrator.agent.node import install_plan
    from orchestrator.control.boot import prepare_artifacts
    from orchestrator.control.controller import Controller
    from orchestrator.control.store import Store
    from orchestrator.planning.placement import plan_for
    from providers.bootstrap import INSTALL_SPEC_ENV

    monkeypatch.setenv(INSTALL_SPEC_ENV, "tfsn")      # no wheel to build: the code archive is what is tested
    home = tmp_path / "home-controller"
    home.mkdir()
    store = Store(home / "tfsn.db")
    controller = Controller(store, home, providers={})
    job = store.create_job("planned", spec.model_dump(mode="json"), "p", "secret")
    store.update_job(job.id, plan=[c.to_record() for c in plan_for(spec).ranked(3)])   # the plan's result is cached
    archive = controller.ctx.artifacts.path(prepare_artifacts(controller.ctx, store.job(job.id), spec)["code"])
    workdir, cache = tmp_path / "node" / "workdir", tmp_path / "node" / "cache"
    workdir.mkdir(parents=True)
    with tarfile.open(archive) as packed:
        packed.extractall(workdir, filter="data")
    return workdir, cache, install_plan(str(workdir), {"TFSN_CACHE": str(cache)})


def test_a_worker_on_a_local_or_a_cloud_node_runs_the_plan_searched_for_its_hardware_and_searches_only_elsewhere(
        tfsn, tmp_path, monkeypatch):
    from optimizer.hardware import GENERIC_CPU, host_cpu_model, load_all
    from orchestrator.planning.placement import local_worker_threads, planned_hardware
    from orchestrator.spec import load_spec

    cache = tmp_path / "cache"
    monkeypatch.setenv("TFSN_CACHE", str(cache))          # this process names the hardware as the controller does
    tfsn.env.update(TFSN_CACHE=str(cache))
    (tmp_path / "train.py").write_text(SCRIPT)
    spec_file = tmp_path / "train.yaml"
    spec_file.write_text("name: planned\nrun: python train.py\nnum_nodes: 2\nsteps: 10\nresources:\n  infra: [local]\n"
                         "model:\n  entry: train.py:build\n")
    plan = json.loads(tfsn("plan", str(spec_file), "--json", timeout=300).stdout)
    assert plan["hardware"][0]["source"] == "searched graph", plan["hardware"]

    spec = load_spec(spec_file)
    env = {**tfsn.env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(local_worker_threads(spec, 1)),
           "TFSN_PLANNED_HARDWARE": planned_hardware({"accelerator": None}, on_this_machine=True)}
    stats, log = _worker(tmp_path, env, "same")
    assert stats["searches"] == 0 and stats["graphs"] >= 2 and stats["aten_graphs"] == 0, (stats, log)
    assert "searching" not in log, log
    assert abs(stats["loss"] - stats["eager"]) <= 1e-5 * abs(stats["eager"])

    # a cloud node whose cache starts empty: the plan's entries came with the code, and the agent installed them
    workdir, node_cache, said = _cloud_node(tmp_path, spec, monkeypatch)
    shipped = sorted(p.name for p in (workdir / ".tfsn-plan").iterdir())
    assert 0 < len(shipped) <= stats["graphs"] and f"{len(shipped)} search entries of the job's plan installed" in said
    assert sorted(p.name for p in (node_cache / "search").iterdir()) == shipped
    node_env = {**env, "TFSN_CACHE": str(node_cache)}
    stats, log = _worker(workdir, node_env, "node")
    assert stats["searches"] == 0 and stats["aten_graphs"] == 0, (stats, log)
    assert "search" not in log, log

    # an entry that came corrupt: said, and that graph searched again (the others still run the plan)
    (node_cache / "search" / shipped[0]).write_text("{not json")
    stats, log = _worker(workdir, node_env, "corrupt")
    assert stats["searches"] == 1, (stats, log)
    assert f"search cache {node_cache / 'search' / shipped[0]} unreadable" in log, log

    # a replacement node of another type: this CPU measured as another spec (a calibration of it)
    other = {**yaml.safe_load((ROOT / "configs" / "hardware" / f"{GENERIC_CPU}.yaml").read_text()),
             "name": "replacement-cpu", "cpu_model": host_cpu_model()}
    assert load_all()[GENERIC_CPU].name != other["name"]
    (node_cache / "hardware").mkdir(parents=True, exist_ok=True)
    (node_cache / "hardware" / "host.yaml").write_text(yaml.safe_dump(other))
    stats, log = _worker(workdir, node_env, "other")
    assert stats["searches"] >= 2, (stats, log)
    [line] = [text for text in log.splitlines() if "is not what the job's plan was searched for" in text]
    assert "replacement-cpu@" in line and env["TFSN_PLANNED_HARDWARE"] in line, line
