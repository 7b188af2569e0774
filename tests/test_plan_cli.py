"""`tfsn plan` and `tfsn catalog` through the real command line."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from providers.base import MissingExtraError, Offer
from providers.catalog import load_offers, write_offers

SPEC = """\
name: plan-me
run: python train.py
steps: 2000
resources:
  accelerators: {T4: 4, H100: 8, A100-80GB: 8}
model:
  params: 350M
  layers: 24
  hidden: 1024
  seq_len: 2048
  batch_size: 512
"""


@pytest.fixture
def cli(tfsn, tmp_path):
    """The real `tfsn` command, isolated from any local catalog cache or SkyPilot catalog."""
    tfsn.env.update(TFSN_CACHE=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
    return tfsn


def _spec(tmp_path: Path, text: str = SPEC) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(text)
    return path


def test_plan_json_ranks_the_shipped_catalog_by_predicted_cost(cli, tmp_path):
    out = cli("plan", str(_spec(tmp_path)), "--json")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    offers = result["offers"]
    keys = {"provider", "region", "instance_type", "accelerator", "accelerator_count", "spot", "price_per_hour",
            "predicted_hours", "predicted_cost"}
    assert offers and all(keys <= set(o) for o in offers)
    assert [o["predicted_cost"] for o in offers] == sorted(o["predicted_cost"] for o in offers)
    assert result["chosen"] == offers[0]
    assert result["naive"]["price_per_hour"] == min(o["price_per_hour"] for o in offers)
    assert {o["accelerator"] for o in offers} <= {"T4", "H100", "A100-80GB"}
    assert all(o["predicted_cost"] == pytest.approx(o["price_per_hour"] * o["predicted_hours"], rel=1e-4)
               for o in offers)
    assert result["steps"] == 2000 and result["reference_workload"] is False


def test_plan_prints_the_table_the_choice_and_the_naive_plan(cli, tmp_path):
    catalog = tmp_path / "mine.csv"
    write_offers(catalog, [Offer("cloudA", "r1", "z1", "t4-box", "T4", 4, 16.0, 48, 192, 3.912),
                           Offer("cloudB", "r2", None, "h100-box", "H100", 8, 80.0, 192, 2048, 98.32)])
    out = cli("plan", str(_spec(tmp_path)), "--catalog", str(catalog)).stdout
    assert "h100-box" in out and "t4-box" in out
    chosen = next(line for line in out.splitlines() if line.startswith("chosen"))
    naive = next(line for line in out.splitlines() if line.startswith("naive"))
    assert "h100-box" in chosen and "t4-box" in naive
    assert "less" in out and "than the naive plan" in out


def test_plan_states_the_memory_of_a_worker_not_of_a_device(cli, tmp_path):
    # 4 workers on a CPU node hold 4 replicas in its memory: "N GiB per device" was one replica's, a quarter of it
    catalog = tmp_path / "mine.csv"
    write_offers(catalog, [Offer("aws", "r2", None, "c-box", None, 0, 0.0, 64, 512, 2.0)])
    text = SPEC.replace("  accelerators: {T4: 4, H100: 8, A100-80GB: 8}\n", "  infra: [aws]\n")
    out = cli("plan", str(_spec(tmp_path, text + "nproc_per_node: 4\n")), "--catalog", str(catalog)).stdout
    summary = next(line for line in out.splitlines() if "capable offer(s)" in line)
    assert "GiB per worker (a whole replica each)" in summary and "per device" not in summary


def test_plan_refuses_more_workers_than_a_nodes_accelerators_naming_the_line(cli, tmp_path):
    # 16 workers on 8 H100s cannot start (worker 8 has no GPU 8): it was planned, and the nodes paid for
    catalog = tmp_path / "mine.csv"
    write_offers(catalog, [Offer("cloudB", "r2", None, "h100-box", "H100", 8, 80.0, 192, 2048, 98.32)])
    path = _spec(tmp_path, SPEC + "nproc_per_node: 16\n")
    out = cli("plan", str(path), "--catalog", str(catalog), check=False)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"tfsn: error: {path}:12: no capable offer: nproc_per_node 16 ")
    assert out.stderr.strip().endswith("To fix: set nproc_per_node: auto (one worker per accelerator) or at most 8")


def test_plan_of_a_bad_file_is_one_line_naming_file_line_and_field(cli, tmp_path):
    path = _spec(tmp_path, SPEC.replace("params: 350M", "params: lots"))
    out = cli("plan", str(path), check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (f"tfsn: error: {path}:7: model.params: 'lots' is not a parameter count. "
                                  "To fix: write a count like 1.3e9 or with a unit: '350M', '1.3B', '70B'")


def test_plan_without_a_capable_offer_says_which_constraint_and_how_to_relax_it(cli, tmp_path):
    path = _spec(tmp_path, SPEC.replace("steps: 2000", "steps: 2000\nnum_nodes: 1").replace(
        "accelerators: {T4: 4, H100: 8, A100-80GB: 8}", "accelerators: H100:8\n  max_hourly_cost: 10"))
    out = cli("plan", str(path), check=False)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith(f"tfsn: error: {path}:7: no capable offer: ")     # the line, as `tfsn validate` says
    assert "resources.max_hourly_cost 10 removed the last" in out.stderr
    assert "To fix: raise max_hourly_cost to at least" in out.stderr


def test_plan_with_a_missing_catalog_is_a_one_line_error(cli, tmp_path):
    out = cli("plan", str(_spec(tmp_path)), "--catalog", str(tmp_path / "nope.csv"), check=False)
    assert out.returncode == 2 and "no such file or folder" in out.stderr and "Traceback" not in out.stderr


def test_catalog_ls_filters_by_accelerator_and_provider(cli):
    rows = json.loads(cli("catalog", "ls", "--accelerator", "h100", "--provider", "gcp", "--json").stdout)
    assert rows and {(r["provider"], r["accelerator"]) for r in rows} == {("gcp", "H100")}
    out = cli("catalog", "ls", "--accelerator", "H1000", check=False)
    assert out.returncode == 2 and "no such accelerator" in out.stderr and "H100" in out.stderr


def _driver(fetch) -> types.ModuleType:
    """A provider module as the catalog refresh sees it: something with fetch_offers()."""
    module = types.ModuleType("providers.gcp")
    module.fetch_offers = fetch
    return module


def test_catalog_refresh_writes_the_cache_that_later_plans_read(tmp_path, monkeypatch):
    from orchestrator.cli.main import app

    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))
    fetched = [Offer("gcp", "us-central1", "us-central1-a", "a3-highgpu-8g", "H100", 8, 80.0, 208, 1872, 88.5, 20.0)]
    monkeypatch.setitem(sys.modules, "providers.gcp", _driver(lambda regions=None: fetched))
    result = CliRunner().invoke(app, ["catalog", "refresh", "gcp"])
    assert result.exit_code == 0, result.output
    assert load_offers("gcp") == fetched
    assert (tmp_path / "cache" / "catalog" / "gcp.csv").is_file()


def test_catalog_refresh_without_the_sdk_shows_the_one_line_error_and_exits_1(tmp_path, monkeypatch):
    from orchestrator.cli.main import app

    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))

    def fetch(regions=None):
        raise MissingExtraError("the gcp provider needs google (No module named 'google'). "
                                "To fix: pip install 'tfsn[gcp]'", provider="gcp")

    monkeypatch.setitem(sys.modules, "providers.gcp", _driver(fetch))
    result = CliRunner().invoke(app, ["catalog", "refresh", "gcp"])
    assert result.exit_code == 1
    assert "catalog refresh gcp: the gcp provider needs google" in result.output
    assert not (tmp_path / "cache").exists()


def test_plan_leaves_out_a_cloud_whose_offers_cannot_be_read_with_a_warning_naming_it(cli, tmp_path):
    """Before: a Kubernetes cluster that cannot be reached failed `tfsn plan` of a job that allows aws too; now the
    plan is aws's, with the warning that the controller's job events give of a launch."""
    cli.env.update(KUBECONFIG=str(tmp_path / "no-kubeconfig"))
    path = _spec(tmp_path, SPEC.replace("accelerators: {T4: 4, H100: 8, A100-80GB: 8}",
                                        "accelerators: H100:8\n  infra: [aws, kubernetes]"))
    out = cli("plan", str(path), "--json")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {o["provider"] for o in result["offers"]} == {"aws"} and "kubernetes" in result["unread"]
    (warning,) = [line for line in out.stderr.splitlines() if "kubernetes" in line]
    assert warning.startswith("tfsn: warning: kubernetes's offers could not be read (") and warning.endswith(
        "): planned without them") and result["unread"]["kubernetes"] in warning


def test_validate_and_launch_warn_of_a_cloud_left_out_of_the_job_s_plan(cli, tmp_path):
    """Before: `tfsn validate` (the check `tfsn launch` runs first) said the job valid and nothing of kubernetes, which
    could not be read: the job would be placed on aws alone, said only in its events after the launch."""
    cli.env.update(KUBECONFIG=str(tmp_path / "no-kubeconfig"))
    path = _spec(tmp_path, SPEC.replace("accelerators: {T4: 4, H100: 8, A100-80GB: 8}",
                                        "accelerators: H100:8\n  infra: [aws, kubernetes]")
                 + f"workdir: {tmp_path}\ncheckpoint: {{dir: s3://bucket/ckpt}}\nenvs: {{AWS_ACCESS_KEY_ID: x}}\n")
    out = cli("validate", str(path))
    assert "valid job" in out.stdout
    (warning,) = [line for line in out.stderr.splitlines() if "kubernetes" in line]
    assert warning.startswith("tfsn: warning: kubernetes's offers could not be read (") and warning.endswith(
        "): planned without them"), out.stderr
