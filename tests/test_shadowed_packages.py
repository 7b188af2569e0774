"""A training script's folder comes first on sys.path, and research projects name their modules `optimizer.py`
and their folders `configs/`: tfsn's own packages of those names must not be replaced by them unnoticed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_script(folder: Path, source: str) -> subprocess.CompletedProcess:
    """`python train.py` in `folder`, as a worker runs a user's script: its folder first on sys.path."""
    (folder / "train.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}    # tfsn as installed (pip install -e)
    return subprocess.run([sys.executable, "train.py"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_users_optimizer_module_is_named_as_the_conflict_in_one_line(tmp_path):
    """Before: `ModuleNotFoundError: No module named 'optimizer.backend'; 'optimizer' is not a package`, from
    deep inside tfsn, for a script beside its own optimizer.py."""
    (tmp_path / "optimizer.py").write_text("LR = 3e-4\n")
    out = run_script(tmp_path, "import torch, tfsn\nimport optimizer\ntfsn.optimize(torch.nn.Linear(2, 2))\n")
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0
    assert last.startswith("tfsn.ShadowedPackage: tfsn: ") and str(tmp_path / "optimizer.py") in last, out.stderr
    assert "rename" in last and "`optimizer`" in last


def test_a_users_folder_without_init_is_named_too(tmp_path):
    """A folder is a namespace package, found before an editable install's packages."""
    (tmp_path / "health").mkdir()
    (tmp_path / "health" / "probes.py").write_text("OK = True\n")
    out = run_script(tmp_path, "import tfsn\ntfsn.init\n")
    assert out.returncode != 0 and str(tmp_path / "health") in out.stderr.strip().splitlines()[-1], out.stderr


def test_a_users_configs_folder_does_not_replace_tfsns_shipped_configs(tmp_path):
    """Hardware specs, the health policy and the catalog snapshots were read through `configs` by name: a project's
    own configs/ folder (a Hydra project's) was read instead ('no *.yaml hardware specs found')."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "train.yaml").write_text("lr: 0.1\n")
    out = run_script(tmp_path, "\n".join([
        "import tfsn",
        "tfsn.check_packages()",
        "from optimizer.hardware import find_hardware",
        "from health.config import HealthConfig",
        "from providers.catalog import load_offers",
        "print(find_hardware('h100').name, HealthConfig.load().hang_min_s > 0, len(load_offers()) > 0)",
    ]))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["H100-SXM", "True", "True"]


def test_the_optimizer_runs_beside_a_users_module_named_as_another_tfsn_package(tmp_path):
    """The optimizer imports no other tfsn package: a project's own health.py or providers/ beside the script does
    not stop torch.compile(backend="tfsn") or tfsn.optimize (it did: every entry checked all four names)."""
    (tmp_path / "health.py").write_text("OK = True\n")
    (tmp_path / "providers").mkdir()
    (tmp_path / "providers" / "__init__.py").write_text("")
    out = run_script(tmp_path, "import tfsn, health, providers\ntfsn.optimize, tfsn.tfsn_backend\nprint(health.OK)\n")
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr
    out = run_script(tmp_path, "import tfsn\ntfsn.init\n")         # the SDK imports them: still named
    assert out.returncode != 0 and "ShadowedPackage" in out.stderr.strip().splitlines()[-1], out.stderr
