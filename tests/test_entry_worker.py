"""Workers run what `tfsn plan` compiled: the step searched for this machine at plan time is what a worker's
`tfsn.optimize` finds, so it searches nothing; a worker on hardware the plan was not searched for searches its
own step and says so in its log.

The worker here is the job's own process as the controller starts it on a local node (OMP_NUM_THREADS and
TFSN_PLANNED_HARDWARE from the controller's rules, the model wrapped in DDP in a gloo group), one rank.
"""
from __future__ import annotations

import json
import subprocess
import sys
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


def _worker(tmp_path: Path, env: dict[str, str], name: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "train.py", str(tmp_path / f"{name}.rendezvous")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_worker_runs_the_plan_searched_for_its_hardware_and_searches_only_on_other_hardware(tfsn, tmp_path,
                                                                                                 monkeypatch):
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

    # a replacement node of another type: this CPU measured as another spec (a calibration of it)
    other = {**yaml.safe_load((ROOT / "configs" / "hardware" / f"{GENERIC_CPU}.yaml").read_text()),
             "name": "replacement-cpu", "cpu_model": host_cpu_model()}
    assert load_all()[GENERIC_CPU].name != other["name"]
    (cache / "hardware").mkdir(parents=True, exist_ok=True)
    (cache / "hardware" / "host.yaml").write_text(yaml.safe_dump(other))
    stats, log = _worker(tmp_path, env, "other")
    assert stats["searches"] >= 2, (stats, log)
    [line] = [text for text in log.splitlines() if "is not what the job's plan was searched for" in text]
    assert "replacement-cpu@" in line and env["TFSN_PLANNED_HARDWARE"] in line, line
