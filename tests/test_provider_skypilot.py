"""The SkyPilot driver's translation of a node request into SkyPilot's own objects, with the real `sky` package.

SkyPilot validates a Resources against its catalog (fetched from the network on first use) and
keeps state under its runtime directory, both fixed when `sky` is imported. So the checks run in
one child Python whose SKY_RUNTIME_DIR is a temporary folder holding a small Lambda catalog, and
report SkyPilot's own serialization of the task (what `sky.launch` sends to its API server).
Launching needs a cloud account: `sky.launch`/`sky.status`/`sky.down` are not exercised here.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from providers.naming import dns_label

ROOT = Path(__file__).resolve().parent.parent

LAMBDA_CATALOG = (
    "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,Region,GpuInfo,SpotPrice\n"
    "gpu_8x_h100_sxm5,H100,8.0,208.0,1800.0,23.92,us-east-1,\"{'Gpus': [{'Name': 'H100', 'Manufacturer': 'NVIDIA', "
    "'Count': 8.0, 'MemoryInfo': {'SizeInMiB': 81920}}], 'TotalGpuMemoryInMiB': 655360}\",\n"
    "gpu_1x_a10,A10,1.0,30.0,200.0,0.75,us-west-1,,\n")

CHILD = r'''
import json, os, sys
import sky, sky.exceptions as exc
from sky.catalog import common
from providers.base import NodeRequest, Offer, ProviderError
from providers import skypilot

catalog = common.get_catalog_path("lambda/vms.csv")
os.makedirs(os.path.dirname(catalog), exist_ok=True)
with open(catalog, "w") as f:
    f.write(sys.argv[1])

def offer(instance_type="gpu_8x_h100_sxm5", region="lambda/us-east-1", spot_price=None):
    return Offer(provider="skypilot", region=region, zone=None, instance_type=instance_type, accelerator="H100",
                 accelerator_count=8, accelerator_memory_gib=80, vcpus=208, memory_gib=1800, price=23.92,
                 spot_price=spot_price)

def request(**kw):
    return NodeRequest(job_id="7", node_id=kw.pop("node_id", "Train_7-n0-ab12"), workdir="/home/me/job",
                       command=["python", "-m", "orchestrator.agent"],
                       env={"TFSN_NODE_ID": "n0", "TFSN_CONTROLLER_URL": "http://10.0.0.1:8080"}, **kw)

def failure(call):
    try:
        call()
    except ProviderError as err:
        return {"type": type(err).__name__, "scope": err.scope, "retryable": err.retryable, "message": str(err)}
    return None

out = {"task": skypilot.task(request(offer=offer())).to_yaml_config(),
       "cluster": skypilot.cluster_name("Train_7-n0-ab12"),
       "unknown_type": failure(lambda: skypilot.task(request(offer=offer("gpu_99x_nothing")))),
       "unknown_region": failure(lambda: skypilot.task(request(offer=offer(region="lambda/us-west-9")))),
       "spot": skypilot.task(request(offer=offer(spot_price=9.0), spot=True)).to_yaml_config()["resources"],
       "spot_without_market": failure(lambda: skypilot.task(request(offer=offer(), spot=True))),
       "not_skypilot": failure(lambda: skypilot.task(request(offer=offer(region="us-east-1"))))}
errors = {"capacity_region": (exc.ResourcesUnavailableError("Failed to acquire resources in us-east-1"), None),
          "capacity_zone": (exc.ResourcesUnavailableError("no capacity"), "us-east-1a"),
          "no_failover": (exc.ResourcesUnavailableError("bad request", no_failover=True), None),
          "no_access": (exc.NoCloudAccessError("Cloud access is not set up. Run: sky check"), None),
          "server_down": (exc.ApiServerConnectionError("http://127.0.0.1:46580"), None)}
for key, (error, zone) in errors.items():
    mapped = skypilot._provider_error(error, "cannot launch", zone)
    out[key] = {"type": type(mapped).__name__, "scope": mapped.scope, "retryable": mapped.retryable,
                "message": str(mapped)}
print(json.dumps(out))
'''


def test_offers_are_skypilots_catalogs_of_clouds_without_a_tfsn_driver(tmp_path, monkeypatch):
    from providers.skypilot import SkyPilotProvider

    monkeypatch.setenv("HOME", str(tmp_path))
    for version, cloud in [("v7", "lambda"), ("v8", "lambda"), ("v8", "aws")]:
        folder = tmp_path / ".sky" / "catalogs" / version / cloud
        folder.mkdir(parents=True)
        (folder / "vms.csv").write_text(LAMBDA_CATALOG if version == "v8" else LAMBDA_CATALOG.splitlines()[0] + "\n")
    offers = {(o.region, o.instance_type): o for o in SkyPilotProvider().offers()}
    assert set(offers) == {("lambda/us-east-1", "gpu_8x_h100_sxm5"), ("lambda/us-west-1", "gpu_1x_a10")}
    h100 = offers["lambda/us-east-1", "gpu_8x_h100_sxm5"]
    assert (h100.provider, h100.accelerator, h100.accelerator_count, h100.price) == ("skypilot", "H100", 8, 23.92)
    assert h100.spot_price is None


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if importlib.util.find_spec("sky") is None:  # importing sky itself takes seconds: the child does it
        pytest.skip("skypilot is not installed (pip install 'tfsn[skypilot]')")
    runtime = tmp_path_factory.mktemp("sky")
    env = {**os.environ, "SKY_RUNTIME_DIR": str(runtime), "HOME": str(runtime),
           "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD, LAMBDA_CATALOG], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_offer_becomes_skypilots_resources(report):
    resources = report["task"]["resources"]
    assert resources["infra"] == "lambda/us-east-1"
    assert resources["instance_type"] == "gpu_8x_h100_sxm5"
    assert resources["use_spot"] is False
    assert resources["labels"] == {"tfsn-job": "7", "tfsn-node": dns_label("Train_7-n0-ab12")}
    assert report["spot"]["use_spot"] is True and report["spot"]["instance_type"] == "gpu_8x_h100_sxm5"


def test_the_task_installs_tfsn_then_runs_the_agent_with_its_env(report):
    task = report["task"]
    assert task["name"] == report["cluster"] and task["num_nodes"] == 1
    # the image's tfsn, else the user's TFSN_INSTALL_SPEC, never the bare name from an index
    assert task["setup"].startswith("command -v tfsn") and '"${TFSN_INSTALL_SPEC:-}"' in task["setup"]
    assert "pip install --quiet tfsn" not in task["setup"] and "exit 1" in task["setup"]
    assert task["run"].endswith("cd /home/me/job && python -m orchestrator.agent")
    assert task["envs"] == {"TFSN_NODE_ID": "n0", "TFSN_CONTROLLER_URL": "http://10.0.0.1:8080"}


def test_cluster_names_are_valid_for_skypilot(report):
    name = report["cluster"]
    assert name.startswith("tfsn-train-7-n0-ab12") and name == name.lower() and len(name) <= 63


def test_what_skypilot_refuses_is_an_invalid_request(report):
    for key in ("unknown_type", "unknown_region", "spot_without_market", "not_skypilot"):
        assert report[key] is not None, key
        assert report[key]["type"] == "InvalidRequestError" and "To fix:" in report[key]["message"], report[key]
    assert "gpu_99x_nothing" in report["unknown_type"]["message"]


def test_skypilot_errors_map_to_failover_scopes(report):
    assert (report["capacity_region"]["type"], report["capacity_region"]["scope"]) == ("CapacityError", "region")
    assert (report["capacity_zone"]["type"], report["capacity_zone"]["scope"]) == ("CapacityError", "zone")
    assert report["capacity_region"]["retryable"] and "Failed to acquire" in report["capacity_region"]["message"]
    assert report["no_failover"]["type"] == "InvalidRequestError"
    assert (report["no_access"]["type"], report["no_access"]["scope"]) == ("AuthError", "provider")
    assert "sky check" in report["no_access"]["message"]
    assert report["server_down"]["type"] == "ProviderError" and report["server_down"]["retryable"]
