"""The GCP provider: one Compute Engine VM per node, through google-cloud-compute (REST).

A node is an instance named after its node id (so a second provision of the same node finds the
first instance: the name is the idempotency key), labelled `tfsn-job` / `tfsn-node` for leak
sweeps, booting a Deep Learning VM image that runs `providers.bootstrap.startup_script` from its
`startup-script` metadata. Inserts are zonal operations: provision waits for the operation (with a
deadline) because that is where a stockout shows (ZONE_RESOURCE_POOL_EXHAUSTED), and a stockout must
reach the planner as a CapacityError for the zone so that it fails over.

Credentials come only from google-auth's default chain (or the `credentials` a caller passes);
nothing here logs them.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any

from providers.base import (AuthError, CapacityError, Clients, Fault, InvalidRequestError, NodeHandle, NodeRequest,
                            NodeStatus, NotFoundError, Offer, ProviderError, QuotaError, fault_error, import_sdk,
                            planned_offer, provider_error, status_on_error, wait_for)
from providers.bootstrap import startup_script
from providers.catalog import ACCELERATOR_MEMORY_GIB, CatalogOffers, load_offers
from providers.identity import CLOUD_PLATFORM_SCOPE, identity_fault
from providers.naming import JOB_TAG, dns_label, node_tags
from providers.sweep import NotConfigured, TaggedResource, tagged

log = logging.getLogger(__name__)

PROVIDER = "gcp"
# A Deep Learning VM image family (CUDA, NVIDIA driver, Python): https://cloud.google.com/deep-learning-vm/docs/images
DEFAULT_IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570"
IMAGE_ENV = "TFSN_GCP_IMAGE"        # another image (family) URL for the boot disk
PROJECT_ENV = "TFSN_GCP_PROJECT"    # the project, when google-auth's default chain has none
BOOT_DISK_GB = 200                  # DLVM images need at least 50 GB; checkpoints and wheels need room
# Machine series whose machine types come with their GPUs; other series (N1) attach them.
BUILTIN_GPU_SERIES = ("a2-", "a3-", "a4-", "a4x-", "g2-")
# GCP accelerator type -> canonical accelerator name (memory per device: providers.catalog).
ACCELERATORS = {
    "nvidia-tesla-k80": "K80", "nvidia-tesla-p4": "P4", "nvidia-tesla-p100": "P100", "nvidia-tesla-v100": "V100",
    "nvidia-tesla-t4": "T4", "nvidia-l4": "L4", "nvidia-tesla-a100": "A100", "nvidia-a100-80gb": "A100-80GB",
    "nvidia-h100-80gb": "H100", "nvidia-h100-mega-80gb": "H100-MEGA", "nvidia-h200-141gb": "H200",
    "nvidia-b200": "B200",
}
GCP_ACCELERATOR = {canonical: gcp for gcp, canonical in ACCELERATORS.items()}
N1_GPU_COUNTS = (1, 2, 4, 8)        # GPUs an N1 VM can attach; paired with n1-standard-(8 x count)
CAPACITY_CODES = {"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"}
# Instance status -> node status (https://cloud.google.com/compute/docs/instances/instance-life-cycle).
STATUSES = {"PROVISIONING": NodeStatus.PENDING, "STAGING": NodeStatus.PENDING, "RUNNING": NodeStatus.RUNNING,
            "STOPPING": NodeStatus.TERMINATED, "STOPPED": NodeStatus.TERMINATED,
            "SUSPENDING": NodeStatus.TERMINATED, "SUSPENDED": NodeStatus.TERMINATED,
            "TERMINATED": NodeStatus.TERMINATED, "REPAIRING": NodeStatus.UNKNOWN}
# The Cloud Billing Catalog prices a VM by parts: vCPUs and RAM per machine family, GPUs per model.
COMPUTE_SERVICE = "services/6F81-5844-456A"    # Compute Engine's id in the Cloud Billing Catalog
BILLING_SKU_RE = re.compile(r"^(?P<spot>Spot Preemptible |Preemptible )?(?:(?P<family>[A-Z][A-Z0-9]*) "
                            r"(?:Predefined )?Instance (?P<part>Core|Ram)|Nvidia (?P<gpu>.+?) GPU) running in ")
BILLING_GPUS = {"Tesla K80": "K80", "Tesla P4": "P4", "Tesla P100": "P100", "Tesla V100": "V100", "Tesla T4": "T4",
                "L4": "L4", "Tesla A100": "A100", "A100 80GB": "A100-80GB", "H100 80GB": "H100",
                "H100 80GB Mega": "H100-MEGA", "H200 141GB": "H200", "B200": "B200"}
RETRY_DEADLINE_S = 60.0             # total time spent retrying one throttled or unavailable call


def instance_name(node_id: str) -> str:
    """The instance of a node: a valid RFC 1035 name, the same for the same id, distinct for distinct ids."""
    return dns_label(f"tfsn-{node_id}")


class GcpProvider(CatalogOffers):
    """Compute Engine VMs (see the module docstring)."""

    name = PROVIDER
    runs_boot_script = True   # its VMs boot with bootstrap.startup_script (the controller serves its files)

    def __init__(self, project: str | None = None, *, credentials: Any = None, api_endpoint: str | None = None,
                 rpc_timeout_s: float = 30.0, operation_timeout_s: float = 600.0,
                 poll_interval_s: float = 2.0) -> None:
        self._project = project or os.environ.get(PROJECT_ENV)
        self._credentials = credentials
        self._api_endpoint = api_endpoint            # every Google API (tests: an emulator's http URL)
        self.rpc_timeout_s = rpc_timeout_s           # one HTTP call
        self.operation_timeout_s = operation_timeout_s   # one insert or delete, end to end
        self.poll_interval_s = poll_interval_s       # first wait between polls of an operation
        self._clients = Clients()

    # -- SDK plumbing --------------------------------------------------------------------------

    def _sdk(self) -> Any:
        return import_sdk("google.cloud.compute_v1", provider=PROVIDER, extra="gcp")

    def _client(self, kind: str) -> Any:
        """One SDK client per kind ("InstancesClient", ..., "CloudCatalogClient"), made on first use."""
        def make() -> Any:
            module = self._sdk() if kind != "CloudCatalogClient" else import_sdk(
                "google.cloud.billing_v1", provider=PROVIDER, extra="gcp")
            self._resolve_credentials()
            options = {"api_endpoint": self._api_endpoint} if self._api_endpoint else None
            return getattr(module, kind)(credentials=self._credentials, client_options=options, transport="rest")
        return self._clients.get(kind, make)

    def _resolve_credentials(self) -> None:
        if self._credentials is not None and self._project:
            return
        import_sdk("google.auth", provider=PROVIDER, extra="gcp")
        import google.auth
        import google.auth.exceptions
        try:
            credentials, project = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
        except google.auth.exceptions.DefaultCredentialsError as err:
            raise AuthError(f"no Google credentials found ({str(err).splitlines()[0]}). To fix: run "
                            "'gcloud auth application-default login' or set GOOGLE_APPLICATION_CREDENTIALS",
                            provider=PROVIDER) from None
        self._credentials = self._credentials or credentials
        self._project = self._project or project
        if not self._project:
            raise InvalidRequestError(f"no GCP project configured. To fix: set {PROJECT_ENV} or "
                                      "'gcloud config set project <id>'", provider=PROVIDER, scope="provider")

    @property
    def project(self) -> str:
        if not self._project:
            self._resolve_credentials()
        return self._project

    def _call(self, kind: str, method: str, **fields: Any) -> Any:
        """One API call with a per-call timeout and bounded retries of throttling and 5xx."""
        from google.api_core import retry as retries
        retry = retries.Retry(predicate=retries.if_transient_error, initial=1.0, maximum=10.0, multiplier=2.0,
                              timeout=RETRY_DEADLINE_S)
        return getattr(self._client(kind), method)(**fields, timeout=self.rpc_timeout_s, retry=retry)

    # -- the Provider protocol -----------------------------------------------------------------

    def provision(self, request: NodeRequest) -> NodeHandle:
        offer = planned_offer(request, PROVIDER)
        from google.api_core import exceptions
        zone = offer.zone or self._first_zone(offer.region)
        name = instance_name(request.node_id)
        handle = NodeHandle(PROVIDER, request.node_id, {"project": self.project, "zone": zone, "name": name})
        doing = f"creating {name} ({offer.instance_type}) in {zone}"
        try:
            operation = self._call("InstancesClient", "insert", project=self.project, zone=zone,
                                   instance_resource=self._instance(request, offer, zone, name))
        except exceptions.Conflict:  # made by an earlier call for this node: the name is the key
            return handle
        except Exception as err:
            raise _provider_error(err, doing, zone=zone) from None
        try:
            self._wait(operation, self.project, zone, doing)
        except TimeoutError:
            self._delete_quietly(handle)  # a VM that may still come up would run unrecorded
            raise CapacityError(f"gcp: {name} ({offer.instance_type}) in {zone} was not created within "
                                f"{self.operation_timeout_s:.0f}s; deleting it. To fix: retry later or in another "
                                "zone", provider=PROVIDER, scope="zone") from None
        return handle

    def status(self, handle: NodeHandle) -> NodeStatus:
        from google.api_core import exceptions
        data = handle.data
        try:
            instance = self._call("InstancesClient", "get", project=data["project"], zone=data["zone"],
                                  instance=data["name"])
        except Exception as err:  # noqa: BLE001 - a spot VM preempted is deleted (instanceTerminationAction DELETE)
            return status_on_error(err, exceptions.NotFound, provider=PROVIDER, name=data["name"])
        return STATUSES.get(instance.status, NodeStatus.UNKNOWN)

    def terminate(self, handle: NodeHandle) -> None:
        from google.api_core import exceptions
        data = handle.data
        if not data.get("name"):  # recorded, then the controller stopped before the answer: the name is the key
            if not (data.get("zone") or data.get("region")):
                return            # never planned on a zone or region: provision never reached the cloud
            data = {"project": self.project, "name": instance_name(handle.node_id),
                    "zone": data.get("zone") or self._first_zone(data["region"])}
        doing = f"deleting {data['name']} in {data['zone']}"
        try:
            operation = self._call("InstancesClient", "delete", project=data["project"], zone=data["zone"],
                                   instance=data["name"])
        except exceptions.NotFound:
            return
        except Exception as err:
            raise _provider_error(err, doing, zone=data["zone"]) from None
        try:
            self._wait(operation, data["project"], data["zone"], doing)
        except TimeoutError:
            raise ProviderError(f"gcp: {data['name']} is still being deleted after {self.operation_timeout_s:.0f}s; "
                                "terminate again later to confirm", provider=PROVIDER) from None

    # -- helpers -------------------------------------------------------------------------------

    def _instance(self, request: NodeRequest, offer: Offer, zone: str, name: str) -> Any:
        """The instance resource: machine type, GPUs, spot scheduling, boot image, labels, startup script."""
        compute = self._sdk()
        accelerators = []
        if offer.accelerator and not offer.instance_type.startswith(BUILTIN_GPU_SERIES):
            gcp_type = GCP_ACCELERATOR.get(offer.accelerator)
            if gcp_type is None:
                raise InvalidRequestError(f"gcp has no accelerator type for {offer.accelerator!r}. To fix: pick one "
                                          f"of {sorted(GCP_ACCELERATOR)}", provider=PROVIDER)
            accelerators = [compute.AcceleratorConfig(
                accelerator_type=f"zones/{zone}/acceleratorTypes/{gcp_type}",
                accelerator_count=offer.accelerator_count)]
        # A GPU VM cannot live-migrate; a spot VM cannot restart and is deleted when preempted.
        scheduling = compute.Scheduling(
            on_host_maintenance="TERMINATE" if offer.accelerator else "MIGRATE",
            automatic_restart=not request.spot)
        if request.spot:
            scheduling.provisioning_model = "SPOT"
            scheduling.instance_termination_action = "DELETE"
        metadata = {"startup-script": startup_script(request), "tfsn-node-id": request.node_id,
                    "install-nvidia-driver": "True"}  # read by Deep Learning VM images
        return compute.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{offer.instance_type}",
            guest_accelerators=accelerators,
            scheduling=scheduling,
            labels=node_tags(request, label_safe=True),
            metadata=compute.Metadata(items=[compute.Items(key=k, value=v) for k, v in metadata.items()]),
            disks=[compute.AttachedDisk(
                boot=True, auto_delete=True,
                initialize_params=compute.AttachedDiskInitializeParams(
                    source_image=os.environ.get(IMAGE_ENV, DEFAULT_IMAGE), disk_size_gb=BOOT_DISK_GB,
                    labels=node_tags(request, label_safe=True)))],  # a disk left by a failed delete is found
            network_interfaces=[compute.NetworkInterface(
                network="global/networks/default",
                access_configs=[compute.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")])],
            # What the node's workers reach the job's bucket as; the API's default is no service account at all.
            service_accounts=[compute.ServiceAccount(email=request.identity, scopes=[CLOUD_PLATFORM_SCOPE])]
            if request.identity else [],
        )

    def _first_zone(self, region: str) -> str:
        """The zone to use when the offer names only its region."""
        try:
            zones = self._call("RegionsClient", "get", project=self.project, region=region).zones
        except Exception as err:
            raise _provider_error(err, f"listing the zones of {region}", zone=None) from None
        return sorted(z.rsplit("/", 1)[-1] for z in zones)[0]

    def _wait(self, operation: Any, project: str, zone: str, doing: str) -> None:
        """Poll the zonal operation of `doing` until DONE; raise its error as a ProviderError, TimeoutError at the
        deadline."""
        name, done = operation.name, self._sdk().Operation.Status.DONE

        def finished() -> bool:
            nonlocal operation
            try:
                operation = self._call("ZoneOperationsClient", "get", project=project, zone=zone, operation=name)
            except Exception as err:
                raise _provider_error(err, f"{doing}: polling operation {name}", zone=zone) from None
            return operation.status == done

        if operation.status != done:  # the insert's or delete's own answer may say DONE already
            wait_for(finished, timeout_s=self.operation_timeout_s, poll_s=self.poll_interval_s)
        errors = list(operation.error.errors)
        if errors:
            message = "; ".join(f"{e.code}: {e.message}" for e in errors)
            fault, detail = _classify_codes(operation.http_error_status_code, [e.code for e in errors], message,
                                            zone=zone)
            raise fault_error(fault, f"{doing}: {detail}", provider=PROVIDER)

    # -- what `tfsn down` finds and deletes (providers.sweep) ------------------------------------

    def tagged_resources(self) -> list[TaggedResource]:
        """The project's instances labelled with a tfsn job, and its labelled disks that no instance uses (a
        boot disk in use goes with its instance)."""
        try:
            self._resolve_credentials()
        except (AuthError, InvalidRequestError) as err:
            raise NotConfigured(str(err), provider=PROVIDER) from None
        found = []
        for kind, client, field_name in (("instance", "InstancesClient", "instances"), ("disk", "DisksClient", "disks")):
            for scope, listed in _aggregated(self, client, f"labels.{JOB_TAG}:*"):
                zone = scope.rsplit("/", 1)[-1]
                found += [tagged(PROVIDER, kind, item.name, zone, dict(item.labels), project=self.project)
                          for item in getattr(listed, field_name)
                          if JOB_TAG in item.labels and not (kind == "disk" and list(item.users))]
        return found

    def delete_resource(self, resource: TaggedResource) -> None:
        if resource.kind == "instance":
            self.terminate(NodeHandle(PROVIDER, resource.node or resource.name, {
                "project": resource.ref["project"], "zone": resource.where, "name": resource.name}))
            return
        from google.api_core import exceptions
        doing = f"deleting disk {resource.name} in {resource.where}"
        try:
            operation = self._call("DisksClient", "delete", project=resource.ref["project"], zone=resource.where,
                                   disk=resource.name)
            self._wait(operation, resource.ref["project"], resource.where, doing)
        except (exceptions.NotFound, NotFoundError):   # gone already, or while its delete ran
            return
        except TimeoutError:
            raise ProviderError(f"gcp: {doing}: not done within {self.operation_timeout_s:.0f}s",
                                provider=PROVIDER) from None
        except ProviderError:
            raise
        except Exception as err:
            raise _provider_error(err, doing, zone=resource.where) from None

    def _delete_quietly(self, handle: NodeHandle) -> None:
        try:
            self._call("InstancesClient", "delete", project=handle.data["project"], zone=handle.data["zone"],
                       instance=handle.data["name"])
        except Exception as err:  # noqa: BLE001 - best effort: the node is recorded, a later terminate retries
            log.warning("gcp: could not delete %s after a timeout: %s", handle.data["name"], err)


def _classify_codes(http_status: int, codes: list[str], message: str, *, zone: str | None) -> tuple[Fault, str]:
    """The fault of a failed request or operation, by its codes and HTTP status, and the cloud's code and message."""
    detail = f"gcp {'/'.join(c for c in codes if c) or http_status}: {message.rstrip('. ')}"
    if "of type 'serviceAccount'" in message or "access to service account" in message:
        # "The resource 'x@p.iam.gserviceaccount.com' of type 'serviceAccount' was not found" (in the insert's
        # operation), or "The user does not have access to service account 'x'..." (the insert itself).
        return identity_fault(PROVIDER, denied="access to service account" in message), detail
    if CAPACITY_CODES & set(codes):
        return Fault(CapacityError, "tfsn fails over to another zone; or retry later", "zone"), detail
    if "QUOTA_EXCEEDED" in codes or "quotaExceeded" in codes:
        everywhere = "GPUS_ALL_REGIONS" in message  # a project-wide quota: no other region helps
        return Fault(QuotaError, "request more quota in the Cloud Console (IAM & Admin > Quotas)",
                     "provider" if everywhere else "region"), detail
    if http_status in (401, 403):
        return Fault(AuthError, "give the credentials the Compute Instance Admin role, or run "
                                "'gcloud auth application-default login'"), detail
    if http_status == 404:
        return Fault(NotFoundError, "check the project, zone, machine type and image"), detail
    if http_status == 400:
        return Fault(InvalidRequestError, f"check the offer's machine type and accelerator in {zone}"), detail
    return Fault(), detail


def _classify(err: Exception, *, zone: str | None) -> tuple[Fault, str]:
    """The fault of a failed request (after the SDK's retries), and the cloud's detail."""
    import google.auth.exceptions
    from google.api_core import exceptions
    if isinstance(err, exceptions.RetryError) and err.cause is not None:
        err = err.cause
    if isinstance(err, (google.auth.exceptions.RefreshError, google.auth.exceptions.DefaultCredentialsError)):
        # A 401 makes the SDK refresh its token: credentials that cannot be refreshed end here.
        return (Fault(AuthError, "run 'gcloud auth application-default login' or set GOOGLE_APPLICATION_CREDENTIALS"),
                f"gcp: the credentials were refused or cannot be refreshed ({err})")
    if isinstance(err, exceptions.GoogleAPICallError):
        codes = [e.get("reason", "") for e in err.errors if isinstance(e, dict)]
        if err.reason:
            codes.append(err.reason)
        return _classify_codes(err.code or 0, codes, err.message, zone=zone)
    return Fault(), f"gcp: {type(err).__name__}: {err}"


def _provider_error(err: Exception, doing: str, *, zone: str | None) -> ProviderError:
    return provider_error(err, doing, _classify, provider=PROVIDER, zone=zone)


def fetch_offers(regions: list[str] | None = None, *, provider: GcpProvider | None = None,
                 snapshot: list[Offer] | None = None) -> list[Offer]:
    """Every VM offer in `regions` (all if None) from the Compute API's machine and accelerator types.

    The Compute API has no prices. They come from the Cloud Billing Catalog (vCPU, RAM and GPU
    prices per region, summed per offer); an offer it cannot price (a family it bills otherwise, or
    the catalog is unreachable) keeps the price of the same offer in the catalog snapshot, and one
    with no price anywhere is left out. The log says how many of each.
    """
    provider = provider or GcpProvider()
    if snapshot is None:
        snapshot = load_offers(PROVIDER)
    known = {(o.instance_type, o.accelerator, o.accelerator_count, o.region): (o.price, o.spot_price)
             for o in snapshot}
    shapes = _vm_shapes(provider, regions)
    rates = _billing_rates(provider)
    offers, from_snapshot, unpriced = [], 0, 0
    for region, zone, machine, gpu, count in shapes:
        accelerator = ACCELERATORS.get(gpu, gpu) if gpu else None
        snapshot_price, snapshot_spot = known.get((machine.name, accelerator, count, region), (None, None))
        price = _billed(rates, machine, accelerator, count, region, spot=False)
        spot = _billed(rates, machine, accelerator, count, region, spot=True)
        if price is None:
            price, spot = snapshot_price, snapshot_spot
            from_snapshot += price is not None
        elif spot is None:
            spot = snapshot_spot
        if price is None:
            unpriced += 1
            continue
        offers.append(Offer(provider=PROVIDER, region=region, zone=zone, instance_type=machine.name,
                            accelerator=accelerator, accelerator_count=count,
                            accelerator_memory_gib=float(ACCELERATOR_MEMORY_GIB.get(accelerator, 0.0)),
                            vcpus=float(machine.guest_cpus), memory_gib=machine.memory_mb / 1024,
                            price=price, spot_price=spot))
    if from_snapshot or unpriced:
        log.warning("gcp: %d offers priced from the catalog snapshot (the billing catalog has no price for them), "
                    "%d left out (no price anywhere)", from_snapshot, unpriced)
    return sorted(offers, key=lambda o: (o.region, o.zone or "", o.instance_type, o.accelerator or ""))


def _vm_shapes(provider: GcpProvider, regions: list[str] | None) -> list[tuple[str, str, Any, str | None, int]]:
    """Every (region, zone, machine type, GCP GPU type, GPU count) a VM can be made of in `regions` (all if
    None): each machine type with the GPUs it comes with, and N1 hosts with each count of attachable GPUs."""
    machines: dict[str, dict[str, Any]] = {}          # zone -> machine type name -> MachineType
    attachable: dict[str, dict[str, int]] = {}        # zone -> accelerator type -> most cards per VM
    for key, scoped in _aggregated(provider, "MachineTypesClient"):
        machines[key.rsplit("/", 1)[-1]] = {m.name: m for m in scoped.machine_types}
    for key, scoped in _aggregated(provider, "AcceleratorTypesClient"):
        attachable[key.rsplit("/", 1)[-1]] = {a.name: a.maximum_cards_per_instance for a in scoped.accelerator_types}
    # GPUs that come only inside accelerator-optimized machine types (A100, H100, L4) cannot go on N1.
    builtin_only = {a.guest_accelerator_type for types in machines.values() for m in types.values()
                    for a in m.accelerators}
    rows: list[tuple[str, str, Any, str | None, int]] = []
    for zone, types in machines.items():
        region = zone.rsplit("-", 1)[0]
        if regions and region not in regions:
            continue
        for machine in types.values():
            if machine.is_shared_cpu:  # billed as a fraction of a core: not worth planning on
                continue
            builtin = list(machine.accelerators)
            gpu, count = ((builtin[0].guest_accelerator_type, builtin[0].guest_accelerator_count) if builtin
                          else (None, 0))
            rows.append((region, zone, machine, gpu, count))
        for gpu, most in attachable.get(zone, {}).items():
            for count in (c for c in N1_GPU_COUNTS if c <= most):
                host = types.get(f"n1-standard-{8 * count}")
                if host is not None and gpu not in builtin_only:
                    rows.append((region, zone, host, gpu, count))
    return rows


def _billing_rates(provider: GcpProvider) -> dict[tuple[str, str, str, bool], float]:
    """(part, family or GPU, region, spot) -> USD per hour (per GiB-hour for "ram"); {} when unreachable.

    part is "core" or "ram" with a machine family ("N1"), or "gpu" with a canonical GPU name.
    """
    rates: dict[tuple[str, str, str, bool], float] = {}
    try:
        for sku in provider._call("CloudCatalogClient", "list_skus",
                                  request={"parent": COMPUTE_SERVICE, "currency_code": "USD"}):
            match = BILLING_SKU_RE.match(sku.description)
            if match is None or sku.category.usage_type not in ("OnDemand", "Preemptible") or not sku.pricing_info:
                continue
            part, name = ("gpu", BILLING_GPUS.get(match["gpu"])) if match["gpu"] else (match["part"].lower(),
                                                                                         match["family"])
            tiers = sku.pricing_info[0].pricing_expression.tiered_rates
            if name is None or not tiers:
                continue
            price = tiers[-1].unit_price  # the tier that applies past the first free units, if any
            for region in sku.service_regions:
                rates[(part, name, region, bool(match["spot"]))] = price.units + price.nanos / 1e9
    except Exception as err:  # noqa: BLE001 - Cloud Billing API off, or no google-cloud-billing: the snapshot prices
        log.warning("gcp: billing catalog unavailable (%s); prices come from the catalog snapshot",
                    _provider_error(err, "listing Compute Engine SKUs", zone=None))
    return rates


def _billed(rates: dict, machine: Any, accelerator: str | None, count: int, region: str, *,
            spot: bool) -> float | None:
    """vCPUs x core rate + GiB x RAM rate + GPUs x GPU rate of the machine's family, or None if a rate is missing."""
    family = machine.name.split("-", 1)[0].upper()
    parts = [(("core", family), machine.guest_cpus), (("ram", family), machine.memory_mb / 1024)]
    if accelerator:
        parts.append((("gpu", accelerator), count))
    total = 0.0
    for (part, name), amount in parts:
        rate = rates.get((part, name, region, spot))
        if rate is None:
            return None
        total += rate * amount
    return round(total, 6)


def _aggregated(provider: GcpProvider, kind: str, where: str = ""):
    """Every (scope key, scoped list) of an aggregated list, page after page (`where`: the API's filter)."""
    request = {"project": provider.project, "max_results": 500, **({"filter": where} if where else {})}
    try:
        yield from provider._call(kind, "aggregated_list", request=request)
    except Exception as err:
        raise _provider_error(err, f"listing {kind.removesuffix('Client')}", zone=None) from None
