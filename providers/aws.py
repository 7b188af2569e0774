"""The AWS provider: a node is one EC2 instance, created through boto3.

The instance boots the tfsn startup script from its user-data, carries the `tfsn-job` and
`tfsn-node` tags (so a sweep finds leaks), and terminates itself when that script's agent shuts
the machine down. Credentials come only from boto3's own chain (env, profile, instance role) and
are never read or logged here. EC2 error codes map to the typed errors of `providers.base`, with
the scope the planner needs for failover: no capacity blocks one zone, a quota one region.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

from providers.base import (AuthError, CapacityError, Clients, Fault, InvalidRequestError, NodeHandle, NodeRequest,
                            NodeStatus, NotFoundError, Offer, ProviderError, QuotaError, import_sdk, planned_offer,
                            provider_error)
from providers.bootstrap import startup_script
from providers.catalog import CatalogOffers
from providers.identity import aws_instance_profile, identity_fault
from providers.naming import JOB_TAG, NODE_TAG, node_tags
from providers.sweep import NotConfigured, TaggedResource, tagged

NAME = "aws"
EXTRA = "aws"
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60
SDK_ATTEMPTS = 5               # botocore's own bounded attempts (standard mode) for every call but RunInstances
RUN_ATTEMPTS = 4               # RunInstances: retried here, on throttling and 5xx only, never on capacity
BACKOFF_S = 0.5                # first RunInstances backoff; doubles per attempt, with jitter
CONSISTENCY_S = 120            # EC2 may not know a new instance id for this long after RunInstances
PRICING_REGION = "us-east-1"   # the Price List API answers from us-east-1 for every region
# The Deep Learning Base AMI (NVIDIA driver, CUDA, Docker) of each region, published by AWS in SSM.
AMI_PARAMETER = "/aws/service/deeplearning/ami/{arch}/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
ZONE_ID = re.compile(r"^[a-z]{2,5}\d+-az\d+$")  # "use1-az1": the catalog's zones (the same place in every account)
LIVE_STATES = ("pending", "running", "stopping", "stopped")
STATES = {"pending": NodeStatus.PENDING, "running": NodeStatus.RUNNING, "shutting-down": NodeStatus.TERMINATED,
          "terminated": NodeStatus.TERMINATED, "stopping": NodeStatus.TERMINATED, "stopped": NodeStatus.TERMINATED}


_CAPACITY = Fault(CapacityError, "try another zone or instance type, or wait", "zone")
_QUOTA = Fault(QuotaError, "ask AWS for a higher quota in this region (Service Quotas console)", "region")
_AUTH = Fault(AuthError, "configure AWS credentials (aws configure, AWS_PROFILE or an instance role) with "
              "ec2:RunInstances, ec2:DescribeInstances, ec2:TerminateInstances, ec2:CreateTags", "provider")
_THROTTLED = Fault(retryable=True)   # throttling and 5xx: the same request may pass later
# EC2 error codes: https://docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html
FAULTS: dict[str, Fault] = {
    "InsufficientInstanceCapacity": _CAPACITY,
    "InsufficientHostCapacity": _CAPACITY,
    "InsufficientCapacity": _CAPACITY,
    "SpotMaxPriceTooLow": Fault(CapacityError, "use the on-demand market or another offer", "offer"),
    "InstanceLimitExceeded": _QUOTA,
    "VcpuLimitExceeded": _QUOTA,
    "MaxSpotInstanceCountExceeded": _QUOTA,
    "AuthFailure": _AUTH,
    "UnauthorizedOperation": _AUTH,
    "InvalidClientTokenId": _AUTH,
    "SignatureDoesNotMatch": _AUTH,
    "ExpiredToken": _AUTH,
    "RequestExpired": _AUTH,
    "OptInRequired": Fault(AuthError, "enable this region for the account, or pick another", "region"),
    "Unsupported": Fault(InvalidRequestError, "pick another zone for this instance type", "offer"),
    "InvalidAMIID.NotFound": Fault(NotFoundError, "set TFSN_AWS_AMI to an AMI of this region", "region"),
    "InvalidAMIID.Malformed": Fault(InvalidRequestError, "set TFSN_AWS_AMI to an id like ami-0abc...", "provider"),
    "ParameterNotFound": Fault(NotFoundError, "set TFSN_AWS_AMI to an AMI of this region", "region"),
    "InvalidParameterValue": Fault(InvalidRequestError, "check the offer's instance type and zone", "offer"),
    "InvalidParameterCombination": Fault(InvalidRequestError, "check the offer's instance type and zone", "offer"),
    **dict.fromkeys(("RequestLimitExceeded", "Throttling", "ThrottlingException", "InternalError", "InternalFailure",
                     "ServiceUnavailable", "Unavailable"), _THROTTLED),
}
_UNREACHABLE = Fault(ProviderError, "check the network and AWS_ENDPOINT_URL", retryable=True)
NOT_FOUND = {"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"}
VOLUME_GONE = {"InvalidVolume.NotFound"}
SWEEP_WORKERS = 8              # regions listed at once by `tfsn down`
SWEEP_REGIONS_ENV = "TFSN_AWS_REGIONS"   # the regions `tfsn down` looks in (comma-separated); default: all enabled
# Catalog names where AWS reports one name for two memory sizes (SkyPilot's names).
BY_MEMORY = {("A100", 81920): "A100-80GB", ("V100", 32768): "V100-32GB"}


def _botocore() -> Any:
    import_sdk("boto3", provider=NAME, extra=EXTRA)
    return import_sdk("botocore.exceptions", provider=NAME, extra=EXTRA)


def _session() -> Any:
    """A boto3 session: one per provider (creating one parses the SDK's service models, ~0.3 s)."""
    return import_sdk("boto3", provider=NAME, extra=EXTRA).session.Session()


def _client(session: Any, service: str, region: str, attempts: int = SDK_ATTEMPTS) -> Any:
    """A boto3 client with timeouts and bounded retries; the endpoint (AWS_ENDPOINT_URL) and credentials
    come from boto3's own configuration chain."""
    config = import_sdk("botocore.config", provider=NAME, extra=EXTRA)
    return session.client(service, region_name=region, config=config.Config(
        connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
        retries={"mode": "standard", "total_max_attempts": attempts}))


def _code(err: Exception) -> str:
    return getattr(err, "response", {}).get("Error", {}).get("Code", "")


def _classify(err: Exception) -> tuple[Fault, str]:
    """The fault of a botocore exception, and EC2's code and message."""
    exc = _botocore()
    if isinstance(err, exc.NoCredentialsError | exc.PartialCredentialsError):
        return _AUTH, f"no AWS credentials found ({err})"
    if isinstance(err, exc.ClientError):
        code, message = _code(err), err.response.get("Error", {}).get("Message", "")
        return _identity_fault(code, message) or FAULTS.get(code, Fault()), f"{code}: {message}"
    return _UNREACHABLE, f"cannot reach EC2 ({type(err).__name__}: {err})"


def _identity_fault(code: str, message: str) -> Fault | None:
    """EC2's refusal of the instance profile: "Value (x) for parameter iamInstanceProfile.name is invalid. Invalid
    IAM Instance Profile name" (none such, or a role's name), or iam:PassRole denied on its role."""
    if code == "InvalidParameterValue" and "iamInstanceProfile" in message:
        return identity_fault(NAME, denied=False)
    if code == "UnauthorizedOperation" and "iam:PassRole" in message:
        return identity_fault(NAME, denied=True)
    return None


def _provider_error(err: Exception, what: str) -> ProviderError:
    return provider_error(err, what, _classify, provider=NAME)


def client_token(node_id: str) -> str:
    """EC2's idempotency token for the node: the node id itself, or its digest where it exceeds 64 chars."""
    return node_id if len(node_id) <= 64 and node_id.isascii() else hashlib.sha256(node_id.encode()).hexdigest()


def canonical_accelerator(name: str, memory_mib: int) -> str:
    """The catalog's name of an accelerator from EC2's GpuInfo (e.g. A100 with 80 GiB is "A100-80GB")."""
    return BY_MEMORY.get((name, memory_mib), name.replace(" ", "-"))


class AwsProvider(CatalogOffers):
    """EC2 instances as nodes (see the module docstring)."""

    name = NAME
    runs_boot_script = True   # its VMs boot with bootstrap.startup_script (the controller serves its files)

    def __init__(self, default_region: str | None = None) -> None:
        # Where to look for a node whose handle lost its region (a crash right after the request).
        self.default_region = default_region or os.environ.get("AWS_REGION") or os.environ.get(
            "AWS_DEFAULT_REGION") or "us-east-1"
        self._session: Any = None
        self._clients = Clients()
        self._zone_names: dict[str, str] = {}

    def _client(self, service: str, region: str, attempts: int = SDK_ATTEMPTS) -> Any:
        def make() -> Any:
            self._session = self._session or _session()
            return _client(self._session, service, region, attempts)
        return self._clients.get((service, region, attempts), make)

    def _ec2(self, region: str, attempts: int = SDK_ATTEMPTS) -> Any:
        return self._client("ec2", region, attempts)

    def image(self, region: str, arch: str) -> str:
        """The AMI to boot: TFSN_AWS_AMI if set, else the region's latest Deep Learning Base AMI from SSM."""
        if os.environ.get("TFSN_AWS_AMI"):
            return os.environ["TFSN_AWS_AMI"]
        name = AMI_PARAMETER.format(arch=arch)
        try:
            return self._client("ssm", region).get_parameter(Name=name)["Parameter"]["Value"]
        except Exception as err:
            raise _provider_error(err, f"cannot look up the AMI {name} in {region}") from None

    def provision(self, request: NodeRequest) -> NodeHandle:
        offer = planned_offer(request, self.name)
        if request.spot and offer.spot_price is None:
            raise InvalidRequestError(f"{offer.instance_type} in {offer.zone or offer.region} has no spot market. "
                                      "To fix: set use_spot: false or pick another offer", provider=self.name)
        existing = self._find(offer.region, request.node_id)
        if existing is not None:  # idempotent: the node was created before (even by another controller)
            return self._handle(request.node_id, offer.region, existing, request.spot)
        params = self._run_params(request, offer)
        reservation = self._run_instances(offer.region, params, f"cannot start {offer.instance_type} in "
                                          f"{offer.zone or offer.region} for node {request.node_id}")
        return self._handle(request.node_id, offer.region, reservation["Instances"][0], request.spot)

    def zone_name(self, region: str, zone: str) -> str:
        """The account's name of a zone ("us-east-1a"); the catalog gives zone ids ("use1-az1"), which name
        the same data center in every account while the names are shuffled per account."""
        if not ZONE_ID.match(zone):
            return zone
        if zone not in self._zone_names:
            try:
                reply = self._ec2(region).describe_availability_zones(ZoneIds=[zone])
            except Exception as err:
                raise _provider_error(err, f"cannot look up zone {zone} in {region}") from None
            self._zone_names[zone] = reply["AvailabilityZones"][0]["ZoneName"]
        return self._zone_names[zone]

    def _run_params(self, request: NodeRequest, offer: Offer) -> dict[str, Any]:
        tags = [{"Key": key, "Value": value} for key, value in node_tags(request).items()]
        tags.append({"Key": "Name", "Value": f"tfsn-{request.node_id}"})
        params: dict[str, Any] = {
            "ImageId": self.image(offer.region, offer.arch),
            "InstanceType": offer.instance_type,
            "MinCount": 1, "MaxCount": 1,
            "ClientToken": client_token(request.node_id),
            "UserData": startup_script(request),
            # The agent powers the machine off when its job is over: that must not leave a stopped disk.
            "InstanceInitiatedShutdownBehavior": "terminate",
            "TagSpecifications": [{"ResourceType": kind, "Tags": tags} for kind in ("instance", "volume")],
        }
        if offer.zone:
            params["Placement"] = {"AvailabilityZone": self.zone_name(offer.region, offer.zone)}
        if request.identity:   # the instance role: what the node's workers reach the job's bucket with
            params["IamInstanceProfile"] = aws_instance_profile(request.identity)
        if request.spot:
            params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        return params

    def _run_instances(self, region: str, params: dict[str, Any], what: str) -> dict[str, Any]:
        """RunInstances with our own bounded backoff: botocore would retry a capacity error (HTTP 500) four
        times, which only delays the failover to another zone. The ClientToken makes a retry safe."""
        ec2 = self._ec2(region, attempts=1)
        attempt = 0
        while True:
            try:
                return ec2.run_instances(**params)
            except Exception as err:
                failure = _provider_error(err, what)
            transient = failure.retryable and type(failure) is ProviderError  # throttled, 5xx, network
            attempt += 1
            if not transient or attempt == RUN_ATTEMPTS:
                raise failure
            time.sleep(BACKOFF_S * 2 ** attempt * (0.5 + random.random()))

    def _find(self, region: str, node_id: str) -> dict[str, Any] | None:
        """The live instance tagged with this node id, if any."""
        try:
            pages = self._ec2(region).get_paginator("describe_instances").paginate(Filters=[
                {"Name": f"tag:{NODE_TAG}", "Values": [node_id]},
                {"Name": "instance-state-name", "Values": list(LIVE_STATES)}])
            return next((i for page in pages for r in page["Reservations"] for i in r["Instances"]), None)
        except Exception as err:
            raise _provider_error(err, f"cannot look up node {node_id} in {region}") from None

    def _handle(self, node_id: str, region: str, instance: dict[str, Any], spot: bool) -> NodeHandle:
        return NodeHandle(provider=self.name, node_id=node_id, data={
            "region": region, "zone": instance.get("Placement", {}).get("AvailabilityZone"),
            "instance_id": instance["InstanceId"], "spot": spot, "requested_at": time.time()})

    def status(self, handle: NodeHandle) -> NodeStatus:
        region = handle.data.get("region", self.default_region)
        instance_id = handle.data.get("instance_id")
        exc = _botocore()
        try:
            if instance_id is None:
                found = self._find(region, handle.node_id)
                return STATES.get(found["State"]["Name"], NodeStatus.UNKNOWN) if found else NodeStatus.TERMINATED
            reply = self._ec2(region).describe_instances(InstanceIds=[instance_id])
        except exc.ClientError as err:
            if _code(err) not in NOT_FOUND:
                return NodeStatus.UNKNOWN
            # EC2 is eventually consistent: a fresh instance id can be unknown for a while.
            young = time.time() - handle.data.get("requested_at", 0) < CONSISTENCY_S
            return NodeStatus.UNKNOWN if young else NodeStatus.TERMINATED
        except (exc.BotoCoreError, ProviderError):
            return NodeStatus.UNKNOWN
        instances = [i for r in reply["Reservations"] for i in r["Instances"]]
        if not instances:
            return NodeStatus.TERMINATED
        return STATES.get(instances[0]["State"]["Name"], NodeStatus.UNKNOWN)

    def terminate(self, handle: NodeHandle) -> None:
        region = handle.data.get("region", self.default_region)
        instance_id = handle.data.get("instance_id")
        if instance_id is None:  # the controller stopped before recording the instance: find it by its tag
            found = self._find(region, handle.node_id)
            if found is None:
                return
            instance_id = found["InstanceId"]
        try:
            self._ec2(region).terminate_instances(InstanceIds=[instance_id])
        except Exception as err:
            if _code(err) not in NOT_FOUND:
                raise _provider_error(err, f"cannot terminate node {handle.node_id} ({instance_id})") from None
            # EC2 is eventually consistent: a fresh instance id can be unknown for a while, and gone it is not
            if time.time() - handle.data.get("requested_at", 0) < CONSISTENCY_S:
                raise ProviderError(f"aws: {instance_id} of node {handle.node_id} is not visible yet; "
                                    "terminating again shortly", provider=self.name) from None

    # -- what `tfsn down` finds and deletes (providers.sweep) ------------------------------------

    def tagged_resources(self) -> list[TaggedResource]:
        """tfsn's live instances and its unattached volumes (an attached one goes with its instance), in every
        region enabled for the account (or those of TFSN_AWS_REGIONS)."""
        wanted = {name.strip() for name in os.environ.get(SWEEP_REGIONS_ENV, "").split(",") if name.strip()}
        session = self._session = self._session or _session()
        if session.get_credentials() is None:
            raise NotConfigured("no AWS credentials (aws configure, AWS_PROFILE, or an instance role)", provider=NAME)
        try:
            enabled = [r["RegionName"] for r in self._ec2(self.default_region).describe_regions()["Regions"]]
            regions = sorted(name for name in enabled if not wanted or name in wanted)
            clients = {region: self._ec2(region) for region in regions}   # made here: making clients is not thread-safe
            with ThreadPoolExecutor(SWEEP_WORKERS) as pool:
                return [r for found in pool.map(_tagged_in_region, clients.values(), regions) for r in found]
        except Exception as err:
            raise _provider_error(err, "cannot list tfsn's instances and volumes") from None

    def delete_resource(self, resource: TaggedResource) -> None:
        ec2, ref = self._ec2(resource.where), resource.ref
        try:
            if resource.kind == "instance":
                ec2.terminate_instances(InstanceIds=[ref["instance_id"]])
            else:
                ec2.delete_volume(VolumeId=ref["volume_id"])
        except Exception as err:
            if _code(err) not in NOT_FOUND | VOLUME_GONE:
                raise _provider_error(err, f"cannot delete {resource.kind} {resource.name}") from None


def _tagged_in_region(ec2: Any, region: str) -> list[TaggedResource]:
    """One region's instances (not yet terminated) and available volumes that carry the job tag."""
    def tags(item: dict[str, Any]) -> dict[str, str]:
        return {t["Key"]: t["Value"] for t in item.get("Tags", [])}

    tag_filter = {"Name": "tag-key", "Values": [JOB_TAG]}
    found = [tagged(NAME, "instance", i["InstanceId"], region, tags(i), instance_id=i["InstanceId"])
             for page in ec2.get_paginator("describe_instances").paginate(Filters=[
                 tag_filter, {"Name": "instance-state-name", "Values": list(LIVE_STATES)}])
             for reservation in page["Reservations"] for i in reservation["Instances"]]
    found += [tagged(NAME, "volume", v["VolumeId"], region, tags(v), volume_id=v["VolumeId"])
              for page in ec2.get_paginator("describe_volumes").paginate(Filters=[
                  tag_filter, {"Name": "status", "Values": ["available"]}])
              for v in page["Volumes"]]
    return found


def fetch_offers(regions: list[str] | None = None) -> list[Offer]:
    """Every GPU instance type of each region (default: the account's enabled regions), one offer per zone,
    priced from the Price List API (on-demand) and the spot price history (spot)."""
    try:
        session = _session()
        if regions is None:
            regions = sorted(r["RegionName"] for r in _client(session, "ec2", PRICING_REGION).describe_regions()[
                "Regions"])
        offers: list[Offer] = []
        for region in regions:
            offers.extend(_region_offers(session, region))
        return offers
    except Exception as err:
        raise _provider_error(err, "cannot refresh the AWS catalog") from None


def _region_offers(session: Any, region: str) -> list[Offer]:
    ec2 = _client(session, "ec2", region)
    types = {t["InstanceType"]: t for page in ec2.get_paginator("describe_instance_types").paginate()
             for t in page["InstanceTypes"] if t.get("GpuInfo", {}).get("Gpus")}
    if not types:
        return []
    zones: dict[str, list[str]] = defaultdict(list)  # zone ids, as SkyPilot's catalog has them
    for page in ec2.get_paginator("describe_instance_type_offerings").paginate(
            LocationType="availability-zone-id", Filters=[{"Name": "instance-type", "Values": sorted(types)}]):
        for row in page["InstanceTypeOfferings"]:
            zones[row["InstanceType"]].append(row["Location"])
    prices = on_demand_prices(_client(session, "pricing", PRICING_REGION), region)
    zone_ids = {z["ZoneName"]: z["ZoneId"] for z in ec2.describe_availability_zones()["AvailabilityZones"]}
    spot = {(name, zone_ids.get(zone, zone)): price for (name, zone), price in spot_prices(ec2, sorted(types)).items()}
    offers = []
    for name, info in sorted(types.items()):
        if name not in prices:  # no Linux on-demand price: not a market tfsn can plan on
            continue
        gpu = info["GpuInfo"]["Gpus"][0]
        network = info.get("NetworkInfo", {})
        for zone in sorted(zones.get(name, [])):
            offers.append(Offer(
                provider=NAME, region=region, zone=zone, instance_type=name,
                accelerator=canonical_accelerator(gpu["Name"], gpu["MemoryInfo"]["SizeInMiB"]),
                accelerator_count=sum(g["Count"] for g in info["GpuInfo"]["Gpus"]),
                accelerator_memory_gib=gpu["MemoryInfo"]["SizeInMiB"] / 1024,
                vcpus=float(info["VCpuInfo"]["DefaultVCpus"]), memory_gib=info["MemoryInfo"]["SizeInMiB"] / 1024,
                price=prices[name], spot_price=spot.get((name, zone)),
                interconnect=f"EFA {network.get('NetworkPerformance', '')}".strip() if network.get(
                    "EfaSupported") else None,
                arch=info.get("ProcessorInfo", {}).get("SupportedArchitectures", ["x86_64"])[0]))
    return offers


def on_demand_prices(pricing: Any, region: str) -> dict[str, float]:
    """$/hour of each instance type in the region: Linux, shared tenancy, no pre-installed software."""
    filters = [{"Type": "TERM_MATCH", "Field": field, "Value": value} for field, value in (
        ("regionCode", region), ("operatingSystem", "Linux"), ("tenancy", "Shared"), ("preInstalledSw", "NA"),
        ("capacitystatus", "Used"))]
    prices: dict[str, float] = {}
    pages = pricing.get_paginator("get_products").paginate(
        ServiceCode="AmazonEC2", Filters=filters)
    for page in pages:
        for item in page["PriceList"]:
            product = json.loads(item)
            for term in product.get("terms", {}).get("OnDemand", {}).values():
                for dimension in term["priceDimensions"].values():
                    usd = float(dimension["pricePerUnit"].get("USD", 0))
                    if dimension.get("unit") == "Hrs" and usd > 0:
                        prices[product["product"]["attributes"]["instanceType"]] = usd
    return prices


def spot_prices(ec2: Any, instance_types: list[str]) -> dict[tuple[str, str], float]:
    """The latest Linux spot price of each (instance type, zone)."""
    latest: dict[tuple[str, str], tuple[datetime, float]] = {}
    pages = ec2.get_paginator("describe_spot_price_history").paginate(
        InstanceTypes=instance_types, ProductDescriptions=["Linux/UNIX"], StartTime=datetime.now(timezone.utc))
    for page in pages:
        for row in page["SpotPriceHistory"]:
            if not row["ProductDescription"].startswith("Linux/UNIX"):
                continue
            key = (row["InstanceType"], row["AvailabilityZone"])
            if key not in latest or row["Timestamp"] > latest[key][0]:
                latest[key] = (row["Timestamp"], float(row["SpotPrice"]))
    return {key: price for key, (_, price) in latest.items()}

