"""`tfsn down`: each cloud's real SDK over HTTP against its local server (moto, the GCP and Azure emulators, kmock).

A store holds a dead job and a live one; nodes of both are created through each driver's own provision (and,
where a cloud can leave more behind, a detached disk or volume with the job's tags). `tfsn down` must find
and delete every resource of the dead job, keep the live job's, delete nothing on --dry-run, and narrow to
one job when given one.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
from rich.console import Console

from orchestrator.cli.down import down
from orchestrator.control.store import JobState, Store
from providers.base import NodeRequest, Offer, import_sdk
from providers.naming import node_tags
from tests.conftest import ROOT

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")
pytest.importorskip("google.cloud.compute_v1")
pytest.importorskip("azure.mgmt.network")
pytest.importorskip("kmock")

from tests.test_provider_aws import aws_server, cloud as aws_account, offer as aws_offer  # noqa: E402,F401
from tests.test_provider_azure import SSH_KEY_ENV, make_provider as azure_provider  # noqa: E402
from tests.test_provider_azure import offer as azure_offer, public_key  # noqa: E402,F401
from tests.test_provider_gcp import PROJECT, make_provider as gcp_provider, offer as gcp_offer  # noqa: E402
from tests.test_provider_kubernetes import PODS, cluster, h100  # noqa: E402,F401
from tests.emulators.azure import AzureEmulator, arm_error  # noqa: E402
from tests.emulators.gcp import GcpEmulator, gcp_error  # noqa: E402


@dataclass
class Cloud:
    """One cloud as a test sees it: its driver, how a node of a job is made there, and what exists there now."""

    driver: Any
    offer: Offer
    made: Callable[[Any, NodeRequest], set[str]]   # (driver, request) -> names of what making the node left there
    present: Callable[[], set[str]]                 # names of every resource the cloud has now
    server: Any = None
    names: dict[str, set[str]] = field(default_factory=dict)   # job id -> names of its resources

    def node(self, job: int, node_id: str, owner: str = "") -> set[str]:
        """Make a node of `job` (of the store `owner`; "" as before owner tags); the names of what it left."""
        request = NodeRequest(job_id=str(job), node_id=node_id, command=["python3", "-m", "orchestrator.agent"],
                              env={"TFSN_NODE_ID": node_id}, workdir="/opt/tfsn", offer=self.offer, owner=owner)
        made = self.made(self.driver, request)
        self.names.setdefault(str(job), set()).update(made)
        return made


def _aws(request) -> Cloud:
    _, ec2, _ = request.getfixturevalue("aws_account")
    # moto builds each region on first use (seconds each): look where the nodes are, and in one more region
    request.getfixturevalue("monkeypatch").setenv("TFSN_AWS_REGIONS", "us-east-1,eu-west-1")
    from providers.aws import AwsProvider

    europe = boto3.client("ec2", region_name="eu-west-1")

    def made(driver, req):
        instance = driver.provision(req).data["instance_id"]
        tags = [{"Key": k, "Value": v} for k, v in node_tags(req).items()]
        volume = europe.create_volume(AvailabilityZone="eu-west-1a", Size=8, TagSpecifications=[
            {"ResourceType": "volume", "Tags": tags}])["VolumeId"]   # a volume left in another region
        return {instance, volume}

    def present():
        reply = ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
        return ({i["InstanceId"] for r in reply["Reservations"] for i in r["Instances"]}
                | {v["VolumeId"] for client in (ec2, europe) for v in client.describe_volumes()["Volumes"]})
    return Cloud(AwsProvider(), aws_offer(), made, present)


def _gcp(request) -> Cloud:
    emulator = GcpEmulator().start()
    request.addfinalizer(emulator.stop)

    def made(driver, req):
        name = driver.provision(req).data["name"]   # its boot disk is named after it and goes with it
        emulator.add_disk(PROJECT, "us-central1-a", f"{name}-data", node_tags(req, label_safe=True))
        return {name, f"{name}-data"}
    return Cloud(gcp_provider(emulator), gcp_offer(), made,
                 lambda: {key[2] for key in emulator.instances} | {key[2] for key in emulator.disks}, emulator)


def _azure(request) -> Cloud:
    request.getfixturevalue("monkeypatch").setenv(SSH_KEY_ENV, request.getfixturevalue("public_key"))
    emulator = AzureEmulator().start()
    request.addfinalizer(emulator.stop)

    def made(driver, req):
        data = driver.provision(req).data
        return {data["vm"], data["nic"]}
    return Cloud(azure_provider(emulator), azure_offer(), made,
                 lambda: set(emulator.vms) | set(emulator.nics) | set(emulator.vnets), emulator)


def _kubernetes(request) -> Cloud:
    k8s = request.getfixturevalue("cluster")
    from providers.kubernetes import KubernetesProvider

    def present():
        return set(k8s.on_loop(lambda k: [key[2] for key, obj in k.objects.items()
                                          if key[0] == PODS and not obj.deleted]))
    return Cloud(KubernetesProvider(), h100(), lambda driver, req: {driver.provision(req).data["pod"]}, present, k8s)


CLOUDS = {"aws": _aws, "gcp": _gcp, "azure": _azure, "kubernetes": _kubernetes}


@pytest.fixture(params=sorted(CLOUDS))
def each_cloud(request) -> Cloud:
    return CLOUDS[request.param](request)


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "tfsn.db")


def job(store: Store, state: JobState) -> int:
    """A job in `state`, through the store's own transitions."""
    made = store.create_job("train", {"name": "train", "num_nodes": 1}, "train.yaml", "token")
    path = {JobState.RUNNING: [JobState.PROVISIONING, JobState.RUNNING],
            JobState.STOPPED: [JobState.PROVISIONING, JobState.RUNNING, JobState.STOPPED]}[state]
    for step in path:
        store.transition(made.id, step)
    return made.id


def run_down(store: Store, cloud: Cloud, job_ref: str | None = None, everything: bool = False,
             dry_run: bool = False, owner: str | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = down(store, [cloud.driver], job_ref, everything, dry_run, Console(file=out, soft_wrap=True),
                Console(file=err, soft_wrap=True), timeout_s=60, owner=owner)
    return code, out.getvalue(), err.getvalue()


def test_a_dead_jobs_resources_are_deleted_and_a_live_jobs_kept(each_cloud, store):
    dead, live = job(store, JobState.STOPPED), job(store, JobState.RUNNING)
    each_cloud.node(dead, f"train-{dead}-n0-aa11")
    each_cloud.node(dead, f"train-{dead}-n1-bb22")
    each_cloud.node(live, f"train-{live}-n0-cc33")
    ours, theirs = each_cloud.names[str(dead)], each_cloud.names[str(live)]
    before = each_cloud.present()
    assert ours | theirs <= before

    code, out, err = run_down(store, each_cloud, dry_run=True)
    assert (code, err) == (0, ""), out + err
    assert all(name in out for name in ours) and not any(name in out for name in theirs), out
    assert each_cloud.present() == before   # a dry run deletes nothing

    code, out, err = run_down(store, each_cloud)
    assert (code, err) == (0, ""), out + err
    assert f"kept {len(theirs)} resource(s) of live job(s) {live}" in out
    after = each_cloud.present()
    assert not ours & after, f"left behind: {ours & after}"
    assert theirs <= after

    code, out, err = run_down(store, each_cloud)   # again: nothing left to do, and no error
    assert (code, err) == (0, "") and "nothing to delete" in out


def test_another_stores_resources_are_kept_whatever_their_job_id(each_cloud, store, tmp_path):
    """Job ids restart at 1 in every store (TFSN_HOME, machine, colleague): a colleague's running job in the same
    account has the id of our finished one. Before the owner tag, `tfsn down` here deleted its nodes."""
    (tmp_path / "theirs").mkdir()
    theirs_store = Store(tmp_path / "theirs" / "tfsn.db")
    ours, theirs = job(store, JobState.STOPPED), job(theirs_store, JobState.RUNNING)
    assert ours == theirs and store.owner != theirs_store.owner
    assert Store(store.path).owner == store.owner   # an id kept by the store, not made per process
    mine = each_cloud.node(ours, f"train-{ours}-n0-aa11", owner=store.owner)
    colleague = each_cloud.node(theirs, f"train-{theirs}-n0-bb22", owner=theirs_store.owner)
    orphan = job(theirs_store, JobState.STOPPED)     # not a job here at all
    colleague |= each_cloud.node(orphan, f"train-{orphan}-n0-cc33", owner=theirs_store.owner)

    code, out, err = run_down(store, each_cloud)
    assert (code, err) == (0, ""), out + err
    assert f"kept {len(colleague)} resource(s) of other tfsn stores ({theirs_store.owner}; this one is {store.owner})" \
        in out, out
    after = each_cloud.present()
    assert not mine & after and colleague <= after
    for job_ref in (None, str(ours)):   # --all takes live jobs' resources and shared ones, never another store's
        code, out, err = run_down(store, each_cloud, job_ref=job_ref, everything=True)
        assert colleague <= each_cloud.present(), out + err
        if each_cloud.driver.name == "azure" and job_ref is None:   # their NIC is in the region's vnet: Azure keeps it
            assert err.strip().endswith("To fix: it goes once nothing uses it: end the jobs whose NICs are in it, "
                                        "then run `tfsn down --all` again"), err
    code, out, err = run_down(theirs_store, each_cloud)   # where they were launched, the dead job's go
    assert (code, err) == (0, ""), out + err
    assert each_cloud.present() & colleague == each_cloud.names[str(theirs)] & colleague
    code, out, err = run_down(store, each_cloud, owner=theirs_store.owner)   # their home is lost: all of it goes
    assert (code, err) == (0, ""), out + err
    assert not colleague & each_cloud.present()


def test_a_job_launched_while_the_clouds_are_listed_keeps_its_nodes(store, request):
    """Listing every region of every cloud takes a while; a job launched meanwhile (another terminal) owns what it
    made. Before, the live jobs were read before the listing and its new node was deleted as a leftover."""
    cloud = _gcp(request)
    listing, launched = cloud.driver.tagged_resources, []

    def list_while_a_job_starts():
        new = job(store, JobState.RUNNING)
        launched.extend(cloud.node(new, f"train-{new}-n0-aa11", owner=store.owner))
        return listing()
    cloud.driver.tagged_resources = list_while_a_job_starts
    code, out, err = run_down(store, cloud)
    assert (code, err) == (0, "") and "nothing to delete" in out, out + err
    assert set(launched) <= cloud.present()


def test_a_job_narrows_the_sweep_to_its_resources(each_cloud, store):
    first, second = job(store, JobState.STOPPED), job(store, JobState.STOPPED)
    each_cloud.node(first, f"train-{first}-n0-aa11")
    each_cloud.node(second, f"train-{second}-n0-bb22")
    code, out, err = run_down(store, each_cloud, job_ref=str(first))
    assert (code, err) == (0, ""), out + err
    after = each_cloud.present()
    assert not each_cloud.names[str(first)] & after
    assert each_cloud.names[str(second)] <= after


def test_a_hung_cloud_does_not_hold_the_others(store, request):
    """Each cloud is swept in its own thread under one deadline: a deletion that never finishes is one line
    when the deadline comes, and the other cloud's resources are deleted meanwhile."""
    hung, azure = _gcp(request), _azure(request)
    hung.driver.operation_timeout_s = 5.0   # past the 3 s deadline of the sweep
    dead = job(store, JobState.STOPPED)
    hung.node(dead, f"train-{dead}-n0-aa11")
    azure.node(dead, f"train-{dead}-n0-aa11")
    hung.server.pending_polls = 10**6   # GCP takes the delete and never finishes it
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    code = down(store, [hung.driver, azure.driver], None, False, False, Console(file=out, soft_wrap=True),
                Console(file=err, soft_wrap=True), timeout_s=3)
    assert time.monotonic() - started < 15
    assert code == 1
    assert err.getvalue().splitlines() == [
        f"tfsn: error: gcp {kind} {name} (us-central1-a): not done when the deadline came (it may still finish: "
        "sweep again to confirm)" for kind, name in (("instance", f"tfsn-train-{dead}-n0-aa11"),
                                                     ("disk", f"tfsn-train-{dead}-n0-aa11-data"))]
    assert not azure.names[str(dead)] & azure.present()


def test_a_live_job_named_is_kept_unless_all(store, request):
    cloud = _gcp(request)
    live = job(store, JobState.RUNNING)
    cloud.node(live, f"train-{live}-n0-aa11")
    code, out, _ = run_down(store, cloud, job_ref=str(live))
    assert code == 0 and f"job {live} is live" in out and "nothing to delete" in out
    assert cloud.names[str(live)] <= cloud.present()
    code, out, _ = run_down(store, cloud, job_ref=str(live), everything=True)
    assert code == 0 and not cloud.names[str(live)] & cloud.present()


def test_a_resource_that_cannot_be_deleted_is_one_line_and_a_failure(store, request):
    cloud = _gcp(request)
    dead = job(store, JobState.STOPPED)
    cloud.node(dead, f"train-{dead}-n0-aa11")
    cloud.node(dead, f"train-{dead}-n1-bb22")
    stuck = f"tfsn-train-{dead}-n0-aa11"
    cloud.server.fail_next("DELETE", f"/instances/{stuck}$", 403,
                           gcp_error(403, "Required 'compute.instances.delete' permission", "forbidden"))
    code, out, err = run_down(store, cloud)
    assert code == 1, out + err
    [line] = err.strip().splitlines()
    assert line.startswith(f"tfsn: error: gcp instance {stuck} (us-central1-a): ") and "permission" in line
    assert "deleted 3 of 4 resource(s)" in out   # the other instance, and both unattached disks
    assert cloud.present() == {stuck}            # the instance and its boot disk, which share its name


def test_the_network_jobs_share_goes_only_with_all_and_after_the_nics(store, request):
    cloud = _azure(request)
    dead = job(store, JobState.STOPPED)
    cloud.node(dead, f"train-{dead}-n0-aa11")
    code, out, _ = run_down(store, cloud)
    assert code == 0 and "kept 1 resource(s) that jobs share (vnet)" in out
    assert cloud.present() == {"tfsn-eastus"}
    cloud.node(dead, f"train-{dead}-n1-bb22")
    code, out, err = run_down(store, cloud, everything=True)
    assert (code, err) == (0, ""), out + err   # the vnet's delete would be refused while a NIC is in its subnet
    assert cloud.present() == set()


def test_a_cloud_that_cannot_be_listed_is_one_line_and_a_failure(store, request):
    cloud = _azure(request)
    cloud.server.fail_next("GET", r"/virtualMachines$", 403, arm_error("AuthorizationFailed", "no read access"),
                           times=10)
    code, _, err = run_down(store, cloud)
    assert code == 1
    [line] = err.strip().splitlines()
    assert line.startswith("tfsn: error: azure: cannot list tfsn's resources: ") and "AuthorizationFailed" in line


def cli_env(home) -> dict[str, str]:
    """This process's environment (moto's endpoint and fake keys, when set) with no other cloud configured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "AZURE_", "KUBE", "CLOUDSDK_"))}
    return {**env, "HOME": str(home), "TFSN_HOME": str(home), "NO_GCE_CHECK": "true", "PYTHONPATH": str(ROOT),
            "TFSN_AWS_REGIONS": "us-east-1"}


@pytest.mark.parametrize("args, problem", [
    (["--owner", "not-an-id"], "--owner: not a store id (12 hex digits, as `tfsn down` prints it)"),
    (["1", "--owner", "0123456789ab"], "name a JOB or --owner, not both: a JOB is a job of this store"),
    ([""], "no job with id or name ''. To fix: run `tfsn ls` to see the jobs")])   # before: swept every job
def test_a_bad_owner_or_job_is_one_line_and_exit_2(tmp_path, args, problem):
    done = subprocess.run([sys.executable, str(ROOT / "tfsn.py"), "down", *args], env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"tfsn: error: {problem}"], done.stderr


def test_the_command_sweeps_aws_and_says_which_clouds_it_skipped(aws_account, tmp_path):
    _, ec2, _ = aws_account
    store = Store(tmp_path / "tfsn.db")
    dead, live = job(store, JobState.STOPPED), job(store, JobState.RUNNING)
    from providers.aws import AwsProvider
    instances = {}
    for job_id in (dead, live):
        request = NodeRequest(job_id=str(job_id), node_id=f"train-{job_id}-n0", command=["true"], env={},
                              workdir="/", offer=aws_offer())
        instances[job_id] = AwsProvider().provision(request).data["instance_id"]

    def tfsn(*args):
        return subprocess.run([sys.executable, str(ROOT / "tfsn.py"), "down", *args], env=cli_env(tmp_path),
                              capture_output=True, text=True, timeout=120)

    def state(job_id):
        reply = ec2.describe_instances(InstanceIds=[instances[job_id]])
        return reply["Reservations"][0]["Instances"][0]["State"]["Name"]

    dry = tfsn("--dry-run")
    assert dry.returncode == 0, dry.stderr
    for cloud in ("gcp", "azure", "kubernetes"):
        assert sum(line.startswith(f"{cloud}: skipped, not configured here") for line in dry.stdout.splitlines()) == 1
    [row] = [line for line in dry.stdout.splitlines() if line.startswith("aws ")]
    assert row.split()[:3] == ["aws", "instance", instances[dead]] and row.split()[4:] == [str(dead), f"train-{dead}-n0"]
    assert state(dead) == "running"

    unknown = tfsn("77")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert unknown.stderr.strip().splitlines() == \
        ["tfsn: error: no job with id 77. To fix: run `tfsn ls` to see the jobs"]

    done = tfsn()
    assert done.returncode == 0, done.stderr
    assert "deleted 1 of 1 resource(s)" in done.stdout
    assert (state(dead), state(live)) == ("terminated", "running")
    assert store.job(live).state is JobState.RUNNING   # the store is only read


def test_a_clouds_import_racing_anothers_is_not_a_missing_sdk(monkeypatch):
    """The clouds are listed in parallel: kubernetes imported while google-auth's thread was importing requests
    saw `requests.utils` half-initialized, and `tfsn down` said "pip install 'tfsn[k8s]'" with it installed."""
    import importlib
    import json
    real, raced = importlib.import_module, []

    def import_during_a_race(name, *args):
        if not raced:
            raced.append(name)
            raise ImportError("cannot import name 'parse_dict_header' from partially initialized module "
                              "'requests.utils' (most likely due to a circular import)")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", import_during_a_race)
    assert import_sdk("json", provider="kubernetes", extra="k8s") is json and raced == ["json"]
