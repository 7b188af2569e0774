"""The AWS driver through real boto3 over HTTP: moto's server, behind a proxy that injects real EC2 faults."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import boto3  # noqa: E402

import providers.aws as aws  # noqa: E402
from providers.base import (AuthError, CapacityError, InvalidRequestError, NodeHandle, NodeRequest,  # noqa: E402
                            NodeStatus, NotFoundError, Offer, ProviderError, QuotaError)
from providers.bootstrap import startup_script  # noqa: E402
from tests.awsfaults import FaultProxy, moto_server, price_list_item  # noqa: E402

REGION = "us-east-1"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}


@pytest.fixture(scope="module")
def aws_server():
    with moto_server() as port:
        proxy = FaultProxy("127.0.0.1", port)
        ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=f"http://127.0.0.1:{port}",
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        # One of moto's own x86_64 AMIs (the same after every reset; listing them is slow, so once).
        image = next(i["ImageId"] for i in ec2.describe_images(Owners=["amazon"])["Images"]
                     if i.get("Architecture") == "x86_64")
        yield proxy, f"http://127.0.0.1:{port}", image
        proxy.close()


@pytest.fixture
def cloud(aws_server, monkeypatch, tmp_path):
    """A fresh moto account reached only through AWS_ENDPOINT_URL, with fake credentials and a moto AMI."""
    proxy, moto_url, image = aws_server
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "TFSN_AWS_AMI"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": proxy.url, "AWS_DEFAULT_REGION": REGION,
                        "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST"), timeout=10).read()
    proxy.rules.clear()
    proxy.calls.clear()
    ec2 = boto3.client("ec2", region_name=REGION)
    monkeypatch.setenv("TFSN_AWS_AMI", image)
    monkeypatch.setattr(aws, "BACKOFF_S", 0.01)  # our own backoff constant, so throttling tests stay fast
    return proxy, ec2, image


def offer(zone: str = "use1-az6", instance_type: str = "p4d.24xlarge", spot_price: float | None = 9.8) -> Offer:
    return Offer(provider="aws", region=REGION, zone=zone, instance_type=instance_type, accelerator="A100",
                 accelerator_count=8, accelerator_memory_gib=40, vcpus=96, memory_gib=1152, price=32.77,
                 spot_price=spot_price)


def request(node_id: str = "train-1-n0-ab12", spot: bool = False, **kw) -> NodeRequest:
    return NodeRequest(job_id="1", node_id=node_id, command=["python", "-m", "orchestrator.agent"],
                       env=kw.pop("env", {"TFSN_NODE_ID": node_id, "TFSN_CONTROLLER_URL": "http://10.0.0.1:8080"}),
                       workdir=kw.pop("workdir", "/opt/job"), offer=kw.pop("offer", offer()), spot=spot, **kw)


def instances(ec2, node_id: str) -> list[dict]:
    reply = ec2.describe_instances(Filters=[{"Name": "tag:tfsn-node", "Values": [node_id]}])
    return [i for r in reply["Reservations"] for i in r["Instances"]]


def test_provision_starts_a_tagged_instance_that_boots_the_agent(cloud):
    _, ec2, image = cloud
    req = request()
    handle = aws.AwsProvider().provision(req)
    [instance] = instances(ec2, req.node_id)
    assert handle.data["instance_id"] == instance["InstanceId"]
    # The catalog's zone id is this account's us-east-1a (moto's mapping, from EC2's own answer).
    [zone] = ec2.describe_availability_zones(ZoneIds=["use1-az6"])["AvailabilityZones"]
    assert (instance["InstanceType"], instance["Placement"]["AvailabilityZone"]) == ("p4d.24xlarge", zone["ZoneName"])
    assert instance["ImageId"] == image
    assert "InstanceLifecycle" not in instance  # on-demand
    tags = {t["Key"]: t["Value"] for t in instance["Tags"]}
    assert tags["tfsn-job"] == "1" and tags["tfsn-node"] == req.node_id
    user_data = ec2.describe_instance_attribute(InstanceId=instance["InstanceId"], Attribute="userData")
    assert base64.b64decode(user_data["UserData"]["Value"]).decode() == startup_script(req)
    assert aws.AwsProvider().status(handle) is NodeStatus.RUNNING


def test_spot_request_gets_a_spot_instance(cloud):
    _, ec2, _ = cloud
    req = request(spot=True)
    aws.AwsProvider().provision(req)
    [instance] = instances(ec2, req.node_id)
    assert instance["InstanceLifecycle"] == "spot"


def test_spot_on_an_offer_without_spot_market_is_refused_before_any_call(cloud):
    proxy, _, _ = cloud
    with pytest.raises(ProviderError, match="no spot market"):
        aws.AwsProvider().provision(request(spot=True, offer=offer(spot_price=None)))
    assert not [c for c in proxy.calls if c.action == "RunInstances"]


def test_same_node_twice_is_one_instance_and_survives_a_controller_restart(cloud):
    proxy, ec2, _ = cloud
    req = request()
    first = aws.AwsProvider().provision(req)
    second = aws.AwsProvider().provision(req)
    assert second.data["instance_id"] == first.data["instance_id"]
    assert len(instances(ec2, req.node_id)) == 1
    sent = [c.params for c in proxy.calls if c.action == "RunInstances"]
    assert [p["ClientToken"] for p in sent] == [req.node_id]  # EC2's own idempotency token on the one request
    # A new controller rebuilds the handle from the JSON it stored.
    restored = NodeHandle(**json.loads(json.dumps(first.__dict__)))
    assert aws.AwsProvider().status(restored) is NodeStatus.RUNNING
    aws.AwsProvider().terminate(restored)
    assert aws.AwsProvider().status(restored) is NodeStatus.TERMINATED
    aws.AwsProvider().terminate(restored)  # a node already gone is not an error


def test_terminate_finds_an_unrecorded_instance_by_its_tag(cloud):
    """A controller that stopped between the request and recording the handle still cleans up."""
    _, ec2, _ = cloud
    req = request()
    aws.AwsProvider().provision(req)
    bare = NodeHandle(provider="aws", node_id=req.node_id)
    assert aws.AwsProvider().status(bare) is NodeStatus.RUNNING
    aws.AwsProvider().terminate(bare)
    assert [i["State"]["Name"] for i in instances(ec2, req.node_id)] == ["terminated"]
    assert aws.AwsProvider().status(bare) is NodeStatus.TERMINATED


def test_unknown_instance_is_unknown_while_ec2_may_lag_then_terminated(cloud):
    handle = NodeHandle(provider="aws", node_id="x", data={"region": REGION, "instance_id": "i-0123456789abcdef0"})
    young = NodeHandle(provider="aws", node_id="x", data={**handle.data, "requested_at": time.time()})
    assert aws.AwsProvider().status(young) is NodeStatus.UNKNOWN
    assert aws.AwsProvider().status(handle) is NodeStatus.TERMINATED


def test_no_capacity_in_a_zone_fails_over_to_the_next_zone(cloud):
    proxy, ec2, _ = cloud
    rule = proxy.fail_ec2("RunInstances", "InsufficientInstanceCapacity",
                          "We currently do not have sufficient p4d.24xlarge capacity in the Availability Zone you "
                          "requested (us-east-1a).", **{"Placement.AvailabilityZone": "us-east-1a"})
    provider, req = aws.AwsProvider(), request()
    with pytest.raises(CapacityError) as caught:
        provider.provision(req)
    assert caught.value.scope == "zone" and caught.value.retryable
    assert "InsufficientInstanceCapacity" in str(caught.value) and "\n" not in str(caught.value)
    assert len(rule.hits) == 1  # no retries of a capacity error: failover is faster

    # The planner's failover (orchestrator.planning.planner): down the ranked offers, skipping what an error's scope
    # blocked. The second offer is another instance type in the zone that had no capacity.
    ranked = [offer("use1-az6"), offer("use1-az6", instance_type="p4de.24xlarge"), offer("use1-az1")]
    blocked, handle = set(), None
    for candidate in ranked:
        if (candidate.region, candidate.zone) in blocked:
            continue
        try:
            handle = provider.provision(request(offer=candidate))
            break
        except CapacityError as err:
            assert err.scope == "zone"
            blocked.add((candidate.region, candidate.zone))
    assert handle is not None and handle.data["zone"] == "us-east-1b"  # use1-az1 in this account
    assert len(rule.hits) == 2  # the zone without capacity was not asked again for another type
    assert [i["Placement"]["AvailabilityZone"] for i in instances(ec2, req.node_id)] == ["us-east-1b"]


@pytest.mark.parametrize("code,status,error,scope", [
    ("VcpuLimitExceeded", 400, QuotaError, "region"),
    ("MaxSpotInstanceCountExceeded", 400, QuotaError, "region"),
    ("UnauthorizedOperation", 403, AuthError, "provider"),
    ("InvalidAMIID.NotFound", 400, NotFoundError, "region"),
])
def test_ec2_errors_map_to_typed_errors_with_their_scope(cloud, code, status, error, scope):
    proxy, ec2, _ = cloud
    proxy.fail_ec2("RunInstances", code, "refused by the test", status=status)
    with pytest.raises(error) as caught:
        aws.AwsProvider().provision(request())
    assert caught.value.scope == scope and code in str(caught.value) and "To fix:" in str(caught.value)
    assert not instances(ec2, request().node_id)


def instance_profile(name: str = "tfsn-node") -> str:
    """An instance profile with a role, made in moto's IAM as a user makes one; its ARN."""
    iam = boto3.client("iam", region_name=REGION)
    iam.create_role(RoleName=f"{name}-role", AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}))
    arn = iam.create_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Arn"]
    iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=f"{name}-role")
    return arn


@pytest.mark.parametrize("by", ["name", "arn"])
def test_the_instance_carries_the_jobs_instance_profile_as_ec2_reports_it(cloud, by):
    proxy, ec2, _ = cloud
    arn = instance_profile()
    req = request(identity="tfsn-node" if by == "name" else arn)
    aws.AwsProvider().provision(req)
    [instance] = instances(ec2, req.node_id)
    assert instance["IamInstanceProfile"]["Arn"] == arn
    [association] = ec2.describe_iam_instance_profile_associations(
        Filters=[{"Name": "instance-id", "Values": [instance["InstanceId"]]}])["IamInstanceProfileAssociations"]
    assert association["IamInstanceProfile"]["Arn"] == arn and association["State"] == "associated"
    [sent] = [c.params for c in proxy.calls if c.action == "RunInstances"]
    assert sent[f"IamInstanceProfile.{by.capitalize()}"] == req.identity


def test_no_identity_asks_for_no_instance_profile(cloud):
    proxy, ec2, _ = cloud
    aws.AwsProvider().provision(request())
    [instance] = instances(ec2, request().node_id)
    assert "IamInstanceProfile" not in instance
    assert not [key for c in proxy.calls if c.action == "RunInstances" for key in c.params
                if key.startswith("IamInstanceProfile")]


@pytest.mark.parametrize("code,status,message,error", [
    ("InvalidParameterValue", 400, "Value (tfsn-node) for parameter iamInstanceProfile.name is invalid. Invalid IAM "
                                    "Instance Profile name", InvalidRequestError),
    ("UnauthorizedOperation", 403, "You are not authorized to perform this operation. User: arn:aws:iam::123456789012:"
                                   "user/ci is not authorized to perform: iam:PassRole on resource: arn:aws:iam::"
                                   "123456789012:role/tfsn-node-role", AuthError),
])
def test_a_refused_instance_profile_blocks_the_cloud_with_the_fix_and_is_not_retried(cloud, code, status, message,
                                                                                        error):
    """EC2's answers (as AWS words them) for a profile that does not exist and for one the caller may not pass:
    every zone would say the same, so the error blocks the provider, and its fix names the spec's field."""
    proxy, ec2, _ = cloud
    rule = proxy.fail_ec2("RunInstances", code, message, status=status, **{"IamInstanceProfile.Name": "tfsn-node"})
    with pytest.raises(error) as caught:
        aws.AwsProvider().provision(request(identity="tfsn-node"))
    text = str(caught.value)
    assert caught.value.scope == "provider" and not caught.value.retryable and "\n" not in text
    assert code in text and "To fix:" in text and "resources.remote_identity.aws" in text
    assert ("iam:PassRole" if error is AuthError else "aws iam create-instance-profile") in text.split("To fix:")[1]
    assert len(rule.hits) == 1 and not instances(ec2, request().node_id)


def test_throttling_is_retried_with_backoff_then_succeeds(cloud):
    proxy, ec2, _ = cloud
    rule = proxy.fail_ec2("RunInstances", "RequestLimitExceeded", "Request limit exceeded.", status=503, times=2)
    aws.AwsProvider().provision(request())
    assert len(rule.hits) == 2 and len(instances(ec2, request().node_id)) == 1


def test_throttling_that_never_ends_gives_up_after_bounded_attempts(cloud):
    proxy, _, _ = cloud
    rule = proxy.fail_ec2("RunInstances", "RequestLimitExceeded", "Request limit exceeded.", status=503)
    with pytest.raises(ProviderError, match="RequestLimitExceeded") as caught:
        aws.AwsProvider().provision(request())
    assert caught.value.retryable and len(rule.hits) == aws.RUN_ATTEMPTS


def test_missing_credentials_is_an_auth_error_naming_the_fix(cloud, monkeypatch):
    for name in CREDENTIALS:
        monkeypatch.delenv(name)
    with pytest.raises(AuthError, match="no AWS credentials found.*To fix: configure AWS credentials") as caught:
        aws.AwsProvider().provision(request())
    assert caught.value.scope == "provider"


def test_default_ami_comes_from_the_deep_learning_ami_ssm_parameter(cloud, monkeypatch):
    proxy, ec2, image = cloud
    monkeypatch.delenv("TFSN_AWS_AMI")
    name = aws.AMI_PARAMETER.format(arch="x86_64")
    proxy.answer_json("AmazonSSM.GetParameter", {"Parameter": {
        "Name": name, "Type": "String", "Value": image, "Version": 42, "DataType": "aws:ec2:image",
        "ARN": f"arn:aws:ssm:{REGION}::parameter{name}", "LastModifiedDate": 1.7e9}})
    req = request()
    aws.AwsProvider().provision(req)
    [lookup] = [c for c in proxy.calls if c.target == "AmazonSSM.GetParameter"]
    assert json.loads(lookup.body)["Name"] == name
    assert instances(ec2, req.node_id)[0]["ImageId"] == image


def test_fetch_offers_prices_every_gpu_type_per_zone(cloud):
    proxy, ec2, _ = cloud
    # moto has no Price List API: the proxy answers GetProducts with AWS's document shape.
    proxy.answer_json("AWSPriceListService.GetProducts", {"FormatVersion": "aws_v1", "PriceList": [
        price_list_item("p4d.24xlarge", REGION, 32.7726), price_list_item("p4de.24xlarge", REGION, 40.9657),
        price_list_item("g5.xlarge", REGION, 1.006), price_list_item("m5.large", REGION, 0.096)]})
    offers = aws.fetch_offers([REGION])
    by_type: dict[str, list[Offer]] = {}
    for o in offers:
        by_type.setdefault(o.instance_type, []).append(o)
    assert set(by_type) == {"p4d.24xlarge", "p4de.24xlarge", "g5.xlarge"}  # GPU types that have a price
    zones = {row["Location"] for row in ec2.describe_instance_type_offerings(
        LocationType="availability-zone-id",
        Filters=[{"Name": "instance-type", "Values": ["p4d.24xlarge"]}])["InstanceTypeOfferings"]}
    assert {o.zone for o in by_type["p4d.24xlarge"]} == zones
    p4d = by_type["p4d.24xlarge"][0]
    assert (p4d.accelerator, p4d.accelerator_count, p4d.accelerator_memory_gib) == ("A100", 8, 40)
    assert (p4d.vcpus, p4d.price, p4d.arch) == (96, 32.7726, "x86_64") and p4d.interconnect.startswith("EFA")
    assert by_type["p4de.24xlarge"][0].accelerator == "A100-80GB"
    assert by_type["g5.xlarge"][0].interconnect is None
    history = ec2.describe_spot_price_history(InstanceTypes=["g5.xlarge"])["SpotPriceHistory"]
    ids = {z["ZoneName"]: z["ZoneId"] for z in ec2.describe_availability_zones()["AvailabilityZones"]}
    spot = {ids[row["AvailabilityZone"]]: float(row["SpotPrice"]) for row in history}
    assert {o.zone: o.spot_price for o in by_type["g5.xlarge"]} == spot
    [pricing] = [c for c in proxy.calls if c.target == "AWSPriceListService.GetProducts"]
    filters = {f["Field"]: f["Value"] for f in json.loads(pricing.body)["Filters"]}
    assert filters["regionCode"] == REGION and filters["operatingSystem"] == "Linux"


def test_fetch_offers_with_refused_credentials_is_an_auth_error(cloud):
    proxy, _, _ = cloud
    proxy.fail_ec2("DescribeInstanceTypes", "AuthFailure", "AWS was not able to validate the provided access "
                   "credentials", status=401)
    with pytest.raises(AuthError, match="AuthFailure"):
        aws.fetch_offers([REGION])


def test_a_job_launched_on_aws_fails_over_to_the_next_zone_and_is_torn_down(cloud, tmp_path, monkeypatch):
    """The whole path: the catalog's offers, the planner's ranking, the controller's failover and
    teardown, the real driver and boto3, and EC2's own capacity error for the cheapest zone."""
    from orchestrator.control.controller import Controller
    from orchestrator.spec import JobSpec
    from orchestrator.control.store import JobState, NodeState, Store
    from providers.catalog import write_offers

    proxy, ec2, _ = cloud
    rule = proxy.fail_ec2("RunInstances", "InsufficientInstanceCapacity", "We currently do not have sufficient "
                          "capacity in the Availability Zone you requested (us-east-1a).",
                          **{"Placement.AvailabilityZone": "us-east-1a"})
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))   # the refreshed catalog `tfsn catalog refresh` writes
    write_offers(tmp_path / "cache" / "catalog" / "aws.csv",
                 [offer("use1-az6"), Offer(**{**offer("use1-az1").__dict__, "price": 33.0})])
    store = Store(tmp_path / "tfsn.db")
    spec = JobSpec.model_validate({"name": "big", "run": "python train.py", "workdir": str(tmp_path), "steps": 100,
                                   "resources": {"accelerators": "A100:8", "infra": ["aws"]}})
    job = store.create_job("big", spec.model_dump(mode="json"), "train.yaml", "t")
    controller = Controller(store, tmp_path, {}, url="http://10.0.0.5:7000")
    for _ in range(3):
        controller.reconcile(job.id)

    (node,) = store.nodes(job.id, active_only=True)
    assert node.state == NodeState.STARTING and node.offer["zone"] == "use1-az1"
    assert [i["Placement"]["AvailabilityZone"] for i in instances(ec2, node.id)] == ["us-east-1b"]
    assert len(rule.hits) == 1 and store.job(job.id).blocked[0]["scope"] == "zone"
    events = [e.message for e in store.events(job.id)]
    assert any("could not be created on aws/use1-az6" in m and "InsufficientInstanceCapacity" in m
               and "next: aws/use1-az1" in m for m in events), events

    store.request_stop(job.id)
    controller.reconcile(job.id)
    assert store.job(job.id).state == JobState.STOPPED
    assert [i["State"]["Name"] for i in instances(ec2, node.id)] in (["shutting-down"], ["terminated"])


def test_a_jobs_vms_run_as_its_instance_profile_and_a_refused_profile_blocks_all_of_aws(cloud, tmp_path, monkeypatch):
    """Through the controller: the spec's resources.remote_identity.aws reaches RunInstances; EC2's refusal of the
    profile is not taken for a zone's fault (the next zone is not asked) and the job fails naming the field."""
    from orchestrator.control.controller import Controller
    from orchestrator.control.store import JobState, Store
    from orchestrator.spec import JobSpec
    from providers.catalog import write_offers

    proxy, ec2, _ = cloud
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))
    write_offers(tmp_path / "cache" / "catalog" / "aws.csv",
                 [offer("use1-az6"), Offer(**{**offer("use1-az1").__dict__, "price": 33.0})])
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, {}, url="http://10.0.0.5:7000")

    def launch(name: str) -> int:
        spec = JobSpec.model_validate({"name": name, "run": "python train.py", "workdir": str(tmp_path), "steps": 9,
                                       "resources": {"accelerators": "A100:8", "infra": ["aws"],
                                                     "remote_identity": {"aws": "tfsn-node"}}})
        job = store.create_job(name, spec.model_dump(mode="json"), "train.yaml", "t")
        for _ in range(4):
            controller.reconcile(job.id)
        return job.id

    rule = proxy.fail_ec2("RunInstances", "InvalidParameterValue", "Value (tfsn-node) for parameter "
                          "iamInstanceProfile.name is invalid. Invalid IAM Instance Profile name", status=400)
    refused = launch("refused")
    assert len(rule.hits) == 1 and store.job(refused).state == JobState.FAILED   # one zone asked, not the next
    assert store.job(refused).blocked[0]["scope"] == "provider"
    assert "resources.remote_identity.aws" in store.job(refused).error, store.job(refused).error

    proxy.rules.clear()
    arn = instance_profile()
    (node,) = store.nodes(launch("allowed"), active_only=True)
    assert [i["IamInstanceProfile"]["Arn"] for i in instances(ec2, node.id)] == [arn]


def test_an_instance_created_just_before_a_controller_crash_is_found_by_its_tag_and_terminated(cloud, tmp_path):
    from orchestrator.control.controller import Controller
    from orchestrator.spec import JobSpec
    from orchestrator.control.store import JobState, NodeState, Store

    _, ec2, _ = cloud
    store = Store(tmp_path / "tfsn.db")
    spec = JobSpec.model_validate({"name": "big", "run": "true", "resources": {"infra": ["aws"]}})
    job = store.create_job("big", spec.model_dump(mode="json"), "train.yaml", "t")
    store.transition(job.id, JobState.PROVISIONING)
    # recorded, requested from EC2, then the controller died before it wrote the instance id down
    store.add_node("big-1-n0-dead", job.id, 0, "aws", offer=offer("use1-az1").__dict__)
    aws.AwsProvider().provision(request("big-1-n0-dead", offer=offer("use1-az1")))
    assert [i["State"]["Name"] for i in instances(ec2, "big-1-n0-dead")] == ["running"]

    controller = Controller(store, tmp_path, {})
    controller.nodes.reconcile_intents()                        # what a new controller does first (off its loop)
    assert controller.calls.settle(30), "the terminate call did not end"

    assert [i["State"]["Name"] for i in instances(ec2, "big-1-n0-dead")] in (["shutting-down"], ["terminated"])
    assert store.node("big-1-n0-dead").state == NodeState.TERMINATED and store.node("big-1-n0-dead").released


def test_an_instance_boots_its_real_user_data_and_its_power_off_terminates_it(cloud, tmp_path):
    """moto plays EC2's API, tests/vmsandbox.py its machines: the driver's user-data runs in a sandbox VM. With
    no controller to reach, the boot fails, powers off, and the instance is gone for the controller too."""
    from tests.vmsandbox import Ec2Player, assert_a_failed_boot_powers_off, vm_image
    _, ec2, _ = cloud
    player = Ec2Player(ec2, tmp_path / "vms", vm_image(tmp_path / "image"))
    assert_a_failed_boot_powers_off(player, aws.AwsProvider(), request())


TRAIN = """import os, pathlib, tempfile, zipfile, orchestrator
print('rank', os.environ['RANK'], 'ran in', os.getcwd(), 'with tfsn from', os.path.dirname(orchestrator.__file__),
      'among', sorted(os.listdir('.')))
if os.environ['RANK'] == '0':
    from orchestrator.control.artifacts import Artifacts
    folder = pathlib.Path(tempfile.mkdtemp())
    wheel = Artifacts(folder).wheel()
    print('repacked:', sorted(zipfile.ZipFile(folder / 'artifacts' / wheel.sha256).namelist()))
"""


def test_a_two_node_job_on_aws_boots_its_vms_from_the_controller_and_runs_to_the_end(cloud, tmp_path):
    """moto plays EC2's API and tests/vmsandbox.py its machines: the controller plans the job on the AWS catalog,
    the driver starts two instances, each boots its user-data (tfsn's wheel and the job's code from the
    controller, over TLS), both agents run the job's command under torchrun, and the teardown ends the VMs."""
    from orchestrator.control.credentials import agent_token
    from orchestrator.spec import JobSpec
    from tests.vmsandbox import Ec2Player, controller_for_vms, run_to_the_end, vm_image, wait_for
    _, ec2, _ = cloud
    code, home = tmp_path / "code", tmp_path / "home"
    code.mkdir()
    home.mkdir()
    (code / "train.py").write_text(TRAIN)
    (code / ".gitignore").write_text("data/\n")
    (code / "data").mkdir()
    (code / "data" / "big.bin").write_bytes(b"0" * 4096)
    (code / ".git").mkdir()
    (code / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    spec = JobSpec.model_validate({"name": "vms", "run": "python train.py", "workdir": str(code), "num_nodes": 2,
                                   "nproc_per_node": 1, "resources": {"infra": ["aws"], "accelerators": "A100:8",
                                                                       "regions": [REGION]}})
    player = Ec2Player(ec2, tmp_path / "vms", vm_image(tmp_path / "image"))
    with controller_for_vms(home, {"aws": aws.AwsProvider()}, player) as controller:
        store = controller.ctx.store
        job, log = run_to_the_end(controller, spec, 300)
        for rank in (0, 1):
            line = next(line for line in log.splitlines() if line.startswith(f"[rank{rank}]: rank {rank} ran in"))
            assert f"{tmp_path / 'vms'}/i-" in line and "/node/workdir with tfsn from" in line, line
            assert str(Path(__file__).parent.parent) not in line   # the VM's own copy of tfsn, not this checkout
            assert line.endswith("among ['.gitignore', 'train.py']"), line   # data/ (ignored) and .git left out
        # a controller run from an installed tfsn (no source tree) repacks the installed distribution's files
        wheel = controller.ctx.artifacts.path(job.artifacts["wheel"])
        assert f"[rank0]: repacked: {sorted(zipfile.ZipFile(wheel).namelist())}" in log
        for node in store.nodes(job.id):
            assert store.node(node.id).boot_failure == ""
            assert agent_token(job.token, node.id) not in "".join(vm.boot_log for vm in player.vms.values())
        wait_for(lambda: all(vm.process.poll() is not None for vm in player.vms.values()), 30, "the VMs' power-off")
        assert len(player.vms) == 2
        states = {i["State"]["Name"] for i in instances(ec2, store.nodes(job.id)[0].id)}
        assert states <= {"shutting-down", "terminated"}, states


# A user's training script: a tiny model, data a function of the step, checkpoints through tfsn. Its first
# attempt (not a resumed one) pauses after PAUSE_AFTER steps, past a checkpoint, for the test to reclaim its VM.
CHECKPOINTED = """import os, time, torch, tfsn
run = tfsn.init()
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
start = run.restore(model=model, optimizer=opt)
print(f"rank {run.rank} starts at step {start}", flush=True)
for step in run.steps(start):
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step))
    loss = (model(x) - x[:, :4]).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    run.log(loss=loss)
    run.checkpoint(model=model, optimizer=opt)
    if start == 0 and step + 1 == int(os.environ.get("PAUSE_AFTER", "0")):
        print(f"paused after step {step + 1}", flush=True)
        time.sleep(600)
run.finish()
"""


def test_a_reclaimed_vm_is_replaced_and_the_job_resumes_from_the_bucket_bit_for_bit(aws_server, cloud, tmp_path,
                                                                                      monkeypatch):
    """Deliverable 7 on emulated AWS: moto plays EC2 and S3, sandboxes the VMs. The job checkpoints to s3://; its
    VM is reclaimed (its processes killed at once, the instance terminated, as a spot reclaim looks); the
    controller starts a replacement, which boots, restores the bucket's last checkpoint and ends with the state
    of a run that was never interrupted, bit for bit."""
    import torch

    from orchestrator.control.artifacts import repack_installed
    from orchestrator.control.store import JobState
    from orchestrator.sdk.checkpoint import list_checkpoints, load_tensors
    from orchestrator.spec import JobSpec
    from tests.vmsandbox import Ec2Player, controller_for_vms, vm_image, wait_for
    proxy, ec2, _ = cloud
    s3_url = aws_server[1]      # S3 straight from moto (the fault proxy is EC2's)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_url)
    boto3.client("s3").create_bucket(Bucket="tfsn-ckpt")
    url, steps, interval, pause = "s3://tfsn-ckpt/reclaimed", 8, 3, 5
    code, home = tmp_path / "code", tmp_path / "home"
    code.mkdir()
    home.mkdir()
    (code / "train.py").write_text(CHECKPOINTED)
    wheels = tmp_path / "wheels"   # the VMs' package index: their image lacks s3fs, the boot installs it
    wheels.mkdir()
    repack_installed(wheels, "s3fs")
    # The machine: moto's endpoint, no credentials of its own. Its role's (moto's) reach the VM only as the instance
    # metadata gives them, to an instance that carries an instance profile: the job's resources.remote_identity.aws.
    machine = {"AWS_ENDPOINT_URL": s3_url, "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
               "PIP_FIND_LINKS": str(wheels)}
    spec = JobSpec.model_validate({
        "name": "reclaimed", "run": "python train.py", "workdir": str(code), "num_nodes": 1, "nproc_per_node": 1,
        "steps": steps, "envs": {"PAUSE_AFTER": str(pause), "OMP_NUM_THREADS": "1"},
        "checkpoint": {"dir": url, "interval": interval},
        "resources": {"infra": ["aws"], "accelerators": "A100:8", "regions": [REGION],
                      "remote_identity": {"aws": instance_profile()}}})
    reference = tmp_path / "reference"   # the same script, never interrupted, on this machine, meanwhile
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TFSN_", "AWS_"))}
    uninterrupted = subprocess.Popen([sys.executable, str(code / "train.py")], cwd=tmp_path, env={
        **env, "PYTHONPATH": str(Path(__file__).parent.parent), "OMP_NUM_THREADS": "1", "TFSN_STEPS": str(steps),
        "TFSN_CHECKPOINT_DIR": str(reference), "TFSN_CHECKPOINT_INTERVAL": str(interval)})
    driver = aws.AwsProvider()
    driver.status_poll_s = 1.0   # the controller asks EC2 about its nodes every second (10 s by default)
    player = Ec2Player(ec2, tmp_path / "vms", vm_image(tmp_path / "image", leave_out=("s3fs",)), machine,
                       role_env=CREDENTIALS)
    try:
        with controller_for_vms(home, {"aws": driver}, player) as controller:
            store = controller.ctx.store
            job = store.create_job("reclaimed", spec.model_dump(mode="json"), "p", "secret")
            log = home / "jobs" / str(job.id) / "job.log"
            paused = f"paused after step {pause}"
            wait_for(lambda: store.job(job.id).state.terminal or (log.is_file() and paused in log.read_text()),
                     120, "the first attempt's pause")
            assert not store.job(job.id).state.terminal, log.read_text()
            wait_for(lambda: [c.step for c in list_checkpoints(url)] == [interval], 30, "the bucket's checkpoint")
            [first] = player.vms
            player.reclaim(first)
            wait_for(lambda: store.job(job.id).state.terminal, 180, "the job's end")
            assert store.job(job.id).state == JobState.SUCCEEDED, log.read_text()
        assert uninterrupted.wait(timeout=120) == 0
    finally:
        uninterrupted.kill()   # nothing, once it ended
    done = store.job(job.id)
    assert done.restarts == 1 and done.restored_step == interval
    assert len(player.vms) == 2 and player.vms[first].shutdown_calls == []   # killed, not powered off
    for vm in player.vms.values():   # each installed s3fs as it booted
        assert list((vm.folder / "python").rglob("s3fs/__init__.py")), vm.boot_log
    assert f"[rank0]: rank 0 starts at step {interval}" in log.read_text()
    assert [c.step for c in list_checkpoints(url)][0] == steps
    expected, got = load_tensors(list_checkpoints(reference)[0].path), load_tensors(list_checkpoints(url)[0].path)
    assert expected.keys() == got.keys() and any(k.startswith("optimizer") for k in got)
    for key in expected:
        assert torch.equal(expected[key], got[key]), f"{key} differs after the reclaim"
