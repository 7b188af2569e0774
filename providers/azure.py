"""The Azure provider: one VM (and its NIC) per node, through azure-mgmt-compute and azure-mgmt-network.

Every node lives in one resource group (TFSN_AZURE_RESOURCE_GROUP, default "tfsn", which must
exist) on a tfsn virtual network per region, created on first use. The VM is named after its node
id (the name is the idempotency key: a second provision finds the first VM), tagged `tfsn-job` /
`tfsn-node`, and runs `providers.bootstrap.startup_script` from its custom data (cloud-init runs a
`#!` script). Its NIC and OS disk have deleteOption Delete, so deleting the VM deletes them.

Creation is a long-running ARM operation that provision waits for (with a deadline): allocation
failures show only at its end, and they must reach the planner as CapacityErrors so that it fails
over. A VM left in a Failed state is deleted before the error is raised; nothing is left behind.

Credentials come only from azure-identity's DefaultAzureCredential (or the `credential` a caller
passes); nothing here logs them.
"""
from __future__ import annotations

import base64
import logging
import os
import re
import time
from typing import Any

from providers.base import (AuthError, CapacityError, Clients, Fault, InvalidRequestError, NodeHandle, NodeRequest,
                            NodeStatus, NotFoundError, Offer, ProviderError, QuotaError, import_sdk, planned_offer,
                            provider_error, status_on_error, wait_for)
from providers.bootstrap import startup_script
from providers.catalog import ACCELERATOR_MEMORY_GIB, CatalogOffers
from providers.identity import identity_fault
from providers.naming import JOB_TAG, dns_label, node_tags
from providers.sweep import NotConfigured, TaggedResource, tagged

log = logging.getLogger(__name__)

PROVIDER = "azure"
SUBSCRIPTION_ENV = "AZURE_SUBSCRIPTION_ID"      # the SDKs' own variable for the subscription
RESOURCE_GROUP_ENV = "TFSN_AZURE_RESOURCE_GROUP"
DEFAULT_RESOURCE_GROUP = "tfsn"
# publisher:offer:sku:version of the boot image; the default is the Ubuntu HPC image with NVIDIA drivers.
IMAGE_ENV = "TFSN_AZURE_IMAGE"
DEFAULT_IMAGE = "microsoft-dsvm:ubuntu-hpc:2204:latest"
SSH_KEY_ENV = "TFSN_AZURE_SSH_PUBLIC_KEY"       # lets a user log in; otherwise no one can (nodes are cattle)
ADMIN_USER = "tfsn"
OS_DISK_GB = 200
ADDRESS_SPACE = "10.200.0.0/16"
NETWORK_TAG = ("tfsn", "network")                # on each region's vnet, which the jobs of that region share
# What `tfsn down` lists: kind, the client, its operations group, whether it belongs to a job (else shared).
SWEPT = (("instance", "compute", "virtual_machines", True), ("nic", "network", "network_interfaces", True),
         ("vnet", "network", "virtual_networks", False))
PRICES_URL = "https://prices.azure.com/api/retail/prices"
CAPACITY_CODES = {"SkuNotAvailable", "AllocationFailed", "ZonalAllocationFailed", "OverconstrainedAllocationRequest",
                  "OverconstrainedZonalAllocationRequest"}
AUTH_CODES = {"AuthorizationFailed", "InvalidAuthenticationToken", "AuthenticationFailed", "LinkedAuthorizationFailed"}
# VM size name pattern -> canonical accelerator name, first match wins (memory per device: providers.catalog).
GPU_SIZES = [(r"H200", "H200"), (r"H100", "H100"), (r"A100_v4$", "A100-80GB"), (r"ND96asr_v4$", "A100"),
             (r"ND40rs_v2$", "V100-32GB"), (r"^Standard_NC\d+r?s_v3$", "V100"), (r"T4_v3$", "T4"),
             (r"MI300X", "MI300X")]   # NV*_A10_v5 sizes hold fractions of a GPU: not offered


class AzureProvider(CatalogOffers):
    """Azure VMs (see the module docstring)."""

    name = PROVIDER
    runs_boot_script = True   # its VMs boot with bootstrap.startup_script (the controller serves its files)

    def __init__(self, subscription_id: str | None = None, *, credential: Any = None,
                 resource_group: str | None = None, base_url: str | None = None,
                 connection_verify: str | bool = True, rpc_timeout_s: float = 60.0,
                 operation_timeout_s: float = 900.0, poll_interval_s: float = 5.0) -> None:
        self._subscription = subscription_id or os.environ.get(SUBSCRIPTION_ENV)
        self._credential = credential
        self.resource_group = resource_group or os.environ.get(RESOURCE_GROUP_ENV, DEFAULT_RESOURCE_GROUP)
        self._base_url = base_url                    # tests: an emulator's https URL
        self._verify = connection_verify             # tests: the emulator's CA file
        self.rpc_timeout_s = rpc_timeout_s           # one HTTP read
        self.operation_timeout_s = operation_timeout_s   # one long-running operation, end to end
        self.poll_interval_s = poll_interval_s       # between polls when the service suggests none
        self._clients = Clients()
        self._networks: set[str] = set()             # regions whose vnet is known to exist
        self._ssh_key: str | None = None

    # -- SDK plumbing --------------------------------------------------------------------------

    def _client(self, kind: str) -> Any:
        """The compute or network management client, made on first use."""
        def make() -> Any:
            module, cls = {"compute": ("azure.mgmt.compute", "ComputeManagementClient"),
                           "network": ("azure.mgmt.network", "NetworkManagementClient")}[kind]
            sdk = import_sdk(module, provider=PROVIDER, extra="azure")
            if not self._subscription:
                raise InvalidRequestError(f"no Azure subscription configured. To fix: export {SUBSCRIPTION_ENV}=<id>",
                                          provider=PROVIDER, scope="provider")
            if self._credential is None:
                identity = import_sdk("azure.identity", provider=PROVIDER, extra="azure")
                quiet = logging.getLogger("azure.identity")
                if quiet.level == logging.NOTSET:  # its failure is in the error raised; a log of it repeats it
                    quiet.setLevel(logging.ERROR)
                self._credential = identity.DefaultAzureCredential()
            options: dict[str, Any] = {"base_url": self._base_url} if self._base_url else {}
            # Timeouts on every call; bounded retries (azure-core honours Retry-After on 429).
            return getattr(sdk, cls)(
                self._credential, self._subscription, connection_verify=self._verify, connection_timeout=10,
                read_timeout=self.rpc_timeout_s, retry_total=4, retry_backoff_factor=1.0, retry_backoff_max=30,
                polling_interval=self.poll_interval_s, **options)
        return self._clients.get(kind, make)

    def _finish(self, poller: Any) -> Any:
        """The result of a long-running operation, which the SDK polls in its own thread; TimeoutError at the
        deadline."""
        wait_for(poller.done, timeout_s=self.operation_timeout_s, poll_s=self.poll_interval_s, pause=poller.wait)
        return poller.result()

    def _id(self, kind: str, name: str) -> str:
        return (f"/subscriptions/{self._subscription}/resourceGroups/{self.resource_group}/providers/{kind}/{name}")

    # -- the Provider protocol -----------------------------------------------------------------

    def provision(self, request: NodeRequest) -> NodeHandle:
        offer = planned_offer(request, PROVIDER)
        from azure.core.exceptions import ResourceNotFoundError
        compute, zonal = self._client("compute"), offer.zone is not None
        handle = self._handle(request.node_id, offer.region)
        vm, nic = handle.data["vm"], handle.data["nic"]
        doing = f"creating {vm} ({offer.instance_type}) in {offer.region}{f' zone {offer.zone}' if zonal else ''}"
        try:
            compute.virtual_machines.get(self.resource_group, vm)
            return handle  # made by an earlier call for this node: the name is the key
        except ResourceNotFoundError as err:
            if _code(err) == "ResourceGroupNotFound":
                raise _provider_error(err, doing, zonal) from None
        except Exception as err:
            raise _provider_error(err, doing, zonal) from None
        try:
            self._ensure_network(offer.region)
            self._finish(self._client("network").network_interfaces.begin_create_or_update(
                self.resource_group, nic, self._nic(request, offer)))
            poller = compute.virtual_machines.begin_create_or_update(self.resource_group, vm,
                                                                     self._vm(request, offer, vm, nic))
        except Exception as err:
            self._delete_quietly("network", nic)  # the VM was refused: its NIC would be left behind
            raise _provider_error(err, doing, zonal) from None
        try:
            self._finish(poller)
        except TimeoutError:
            self._delete_quietly("compute", vm)  # its NIC and disk go with it (deleteOption Delete)
            raise CapacityError(f"azure: {doing}: not done within {self.operation_timeout_s:.0f}s; deleting it. "
                                "To fix: retry later or in another region", provider=PROVIDER,
                                scope="zone" if zonal else "region") from None
        except Exception as err:
            self._delete_quietly("compute", vm)  # a Failed VM still exists (and its NIC and disk)
            raise _provider_error(err, doing, zonal) from None
        return handle

    def status(self, handle: NodeHandle) -> NodeStatus:
        from azure.core.exceptions import ResourceNotFoundError
        group, vm = handle.data["resource_group"], handle.data["vm"]
        try:
            found = self._client("compute").virtual_machines.get(group, vm, expand="instanceView")
        except Exception as err:  # noqa: BLE001 - a spot VM evicted is deleted (evictionPolicy Delete)
            return status_on_error(err, ResourceNotFoundError, provider=PROVIDER, name=vm)
        return _node_status(found)

    def terminate(self, handle: NodeHandle) -> None:
        from azure.core.exceptions import ResourceNotFoundError
        data = handle.data
        if not data.get("vm"):  # recorded, then the controller stopped before the answer: the name is the key
            if not data.get("region"):
                return            # never planned on a region: provision never reached the cloud
            data = self._handle(handle.node_id, data["region"]).data
        # The VM first: a NIC in use cannot be deleted (its deleteOption usually deletes it with the VM).
        for kind, name in (("compute", data["vm"]), ("network", data["nic"])):
            try:
                self._finish(self._begin_delete(kind, name, data["resource_group"]))
            except ResourceNotFoundError:  # its resource group is gone, and the node with it
                continue
            except TimeoutError:
                raise ProviderError(f"azure: {name} is still being deleted after {self.operation_timeout_s:.0f}s; "
                                    "terminate again later to confirm", provider=PROVIDER) from None
            except Exception as err:
                raise _provider_error(err, f"deleting {name}", zonal=False) from None

    # -- what `tfsn down` finds and deletes (providers.sweep) ------------------------------------

    def tagged_resources(self) -> list[TaggedResource]:
        """The resource group's VMs and NICs tagged with a tfsn job, and its tfsn vnets (shared by the jobs of a
        region). A VM's OS disk goes with it (deleteOption Delete). No resource group: tfsn made nothing here."""
        if not self._subscription:
            raise NotConfigured(f"no Azure subscription ({SUBSCRIPTION_ENV} is not set)", provider=PROVIDER)
        missing = import_sdk("azure.core.exceptions", provider=PROVIDER, extra="azure").ResourceNotFoundError
        found = []
        try:
            for kind, client, group, per_job in SWEPT:
                for item in getattr(self._client(client), group).list(self.resource_group):
                    tags = item.tags or {}
                    if (JOB_TAG in tags) if per_job else (tags.get(NETWORK_TAG[0]) == NETWORK_TAG[1]):
                        found.append(tagged(PROVIDER, kind, item.name, f"{self.resource_group}/{item.location}", tags,
                                            group=self.resource_group))
        except missing as err:
            if _code(err) != "ResourceGroupNotFound":
                raise _provider_error(err, f"listing resource group {self.resource_group}", zonal=False) from None
        except Exception as err:
            raise _provider_error(err, f"listing resource group {self.resource_group}", zonal=False) from None
        return found

    def delete_resource(self, resource: TaggedResource) -> None:
        from azure.core.exceptions import ResourceNotFoundError
        kind, group = {"instance": "compute", "nic": "network", "vnet": "vnet"}[resource.kind], resource.ref["group"]
        try:
            self._finish(self._begin_delete(kind, resource.name, group))
        except ResourceNotFoundError:   # its resource group is gone, and the resource with it
            return
        except TimeoutError:
            raise ProviderError(f"azure: deleting {resource.name}: not done within {self.operation_timeout_s:.0f}s",
                                provider=PROVIDER) from None
        except Exception as err:
            raise _provider_error(err, f"deleting {resource.kind} {resource.name}", zonal=False) from None

    # -- helpers -------------------------------------------------------------------------------

    def _handle(self, node_id: str, region: str) -> NodeHandle:
        """Where a node's VM and NIC are, from its id alone (names are the idempotency keys)."""
        vm = dns_label(f"tfsn-{node_id}")  # also a valid Linux host name
        return NodeHandle(PROVIDER, node_id, {"subscription": self._subscription, "region": region,
                                              "resource_group": self.resource_group, "vm": vm, "nic": f"{vm}-nic"})

    def _begin_delete(self, kind: str, name: str, resource_group: str) -> Any:
        """Start deleting a VM, NIC or vnet; ARM answers 204 for one that does not exist, so missing is done."""
        if kind == "compute":
            return self._client("compute").virtual_machines.begin_delete(resource_group, name)
        if kind == "vnet":
            return self._client("network").virtual_networks.begin_delete(resource_group, name)
        return self._client("network").network_interfaces.begin_delete(resource_group, name)

    def _delete_quietly(self, kind: str, name: str) -> None:
        try:
            self._begin_delete(kind, name, self.resource_group)
        except Exception as err:  # noqa: BLE001 - best effort after a failure that is what gets reported
            log.warning("azure: could not delete %s after a failed create: %s", name, err)

    def _ensure_network(self, region: str) -> None:
        """The region's tfsn vnet with one subnet that keeps default outbound access (nodes pip install)."""
        from azure.core.exceptions import ResourceNotFoundError
        if region in self._networks:
            return
        network, name = self._client("network"), f"tfsn-{region}"
        try:
            network.virtual_networks.get(self.resource_group, name)
        except ResourceNotFoundError as err:
            if _code(err) == "ResourceGroupNotFound":
                raise
            self._finish(network.virtual_networks.begin_create_or_update(self.resource_group, name, {
                "location": region, "tags": dict([NETWORK_TAG]),
                "properties": {"addressSpace": {"addressPrefixes": [ADDRESS_SPACE]},
                               "subnets": [{"name": "nodes", "properties": {"addressPrefix": ADDRESS_SPACE,
                                                                            "defaultOutboundAccess": True}}]}}))
        self._networks.add(region)

    def _nic(self, request: NodeRequest, offer: Offer) -> dict:
        subnet = self._id("Microsoft.Network", f"virtualNetworks/tfsn-{offer.region}/subnets/nodes")
        return {"location": offer.region, "tags": node_tags(request),
                "properties": {"ipConfigurations": [{"name": "primary", "properties": {
                    "subnet": {"id": subnet}, "privateIPAllocationMethod": "Dynamic"}}]}}

    def _vm(self, request: NodeRequest, offer: Offer, name: str, nic: str) -> dict:
        """The VM resource: size, image, spot, custom data, tags; NIC and disk deleted with it."""
        publisher, image_offer, sku, version = os.environ.get(IMAGE_ENV, DEFAULT_IMAGE).split(":")
        properties: dict[str, Any] = {
            "hardwareProfile": {"vmSize": offer.instance_type},
            "storageProfile": {
                "imageReference": {"publisher": publisher, "offer": image_offer, "sku": sku, "version": version},
                "osDisk": {"createOption": "FromImage", "deleteOption": "Delete", "diskSizeGB": OS_DISK_GB,
                           "managedDisk": {"storageAccountType": "Premium_LRS"}}},
            "osProfile": {
                "computerName": name, "adminUsername": ADMIN_USER,
                "customData": base64.b64encode(startup_script(request).encode()).decode(),
                "linuxConfiguration": {"disablePasswordAuthentication": True, "ssh": {"publicKeys": [
                    {"path": f"/home/{ADMIN_USER}/.ssh/authorized_keys", "keyData": self._public_key()}]}}},
            "networkProfile": {"networkInterfaces": [
                {"id": self._id("Microsoft.Network", f"networkInterfaces/{nic}"),
                 "properties": {"primary": True, "deleteOption": "Delete"}}]},
        }
        if request.spot:  # evicted spot VMs are deleted, not kept deallocated (and billed for disk)
            properties.update(priority="Spot", evictionPolicy="Delete", billingProfile={"maxPrice": -1})
        body = {"location": offer.region, "tags": node_tags(request), "properties": properties}
        if offer.zone:
            body["zones"] = [offer.zone]
        if request.identity:   # what the node's workers reach the job's container as (IMDS gives its tokens)
            body["identity"] = {"type": "UserAssigned", "userAssignedIdentities": {request.identity: {}}}
        return body

    def _public_key(self) -> str:
        """The user's SSH key if given; else the public half of a throwaway key (Azure requires one)."""
        if self._ssh_key is None:
            self._ssh_key = os.environ.get(SSH_KEY_ENV) or _throwaway_public_key()
        return self._ssh_key


def _throwaway_public_key() -> str:
    rsa = import_sdk("cryptography.hazmat.primitives.asymmetric.rsa", provider=PROVIDER, extra="azure")
    from cryptography.hazmat.primitives import serialization
    key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH).decode()


def _node_status(vm: Any) -> NodeStatus:
    """Provisioning state first (Failed, Deleting), then the power state of the instance view."""
    state = (vm.properties.provisioning_state or "").lower()
    if state in ("failed", "deleting"):
        return NodeStatus.TERMINATED
    view = vm.properties.instance_view
    codes = [s.code for s in (view.statuses if view and view.statuses else []) if s.code]
    power = next((c.split("/", 1)[1] for c in codes if c.startswith("PowerState/")), None)
    if power == "running":
        return NodeStatus.RUNNING
    if power in ("stopping", "stopped", "deallocating", "deallocated"):
        return NodeStatus.TERMINATED
    return NodeStatus.PENDING


def _code(err: Exception) -> str | None:
    error = getattr(err, "error", None)
    return getattr(error, "code", None)


def _classify(err: Exception, *, zonal: bool) -> tuple[Fault, str]:
    """The fault of an Azure SDK exception, with the failover scope it implies, and Azure's code and message."""
    from azure.core.exceptions import ClientAuthenticationError, HttpResponseError
    code, status = _code(err), getattr(err, "status_code", None)
    message = (getattr(getattr(err, "error", None), "message", None) or str(err).splitlines()[0]).rstrip(". ")
    detail = f"{code or status or type(err).__name__}: {message}"
    place = "zone" if zonal or code in ("ZonalAllocationFailed", "OverconstrainedZonalAllocationRequest") else "region"
    if code == "FailedIdentityOperation" or (code == "LinkedAuthorizationFailed" and "userAssignedIdentities" in message):
        # ARM's "Identity operation for resource ... failed ... Resource '.../userAssignedIdentities/x' was not found"
        # and "... does not have permission to perform action 'Microsoft.ManagedIdentity/userAssignedIdentities/
        # assign/action' on the linked scope(s) ..."
        return identity_fault(PROVIDER, denied=code == "LinkedAuthorizationFailed"), detail
    if code in CAPACITY_CODES:
        return Fault(CapacityError, f"tfsn fails over to another {place}; or retry later", place), detail
    if code == "QuotaExceeded" or (code == "OperationNotAllowed" and "quota" in message.lower()):
        return Fault(QuotaError, "request more vCPU quota for this VM family and region in the Azure portal "
                                 "(Subscriptions > Usage + quotas)", "region"), detail
    if isinstance(err, ClientAuthenticationError) or code in AUTH_CODES or status in (401, 403):
        return Fault(AuthError, "'az login', or give the identity the Contributor role on the resource group"), detail
    if code == "ResourceGroupNotFound":
        return Fault(NotFoundError, f"az group create --name <group> --location <region>, or set {RESOURCE_GROUP_ENV}",
                     "provider"), detail
    if status == 404:
        return Fault(NotFoundError), detail
    if code and code.startswith("InUse") and code.endswith("CannotBeDeleted"):   # a delete: another resource holds it
        return Fault(ProviderError, "it goes once nothing uses it: end the jobs whose NICs are in it, then run "
                                    "`tfsn down --all` again", retryable=True), detail
    if status == 400 or (isinstance(err, HttpResponseError) and code in ("InvalidParameter", "BadRequest")):
        return Fault(InvalidRequestError, f"check the offer's VM size and the image ({IMAGE_ENV})"), detail
    return Fault(), detail


def _provider_error(err: Exception, doing: str, zonal: bool) -> ProviderError:
    return provider_error(err, f"azure: {doing}", _classify, provider=PROVIDER, zonal=zonal)


def fetch_offers(regions: list[str] | None = None, *, provider: AzureProvider | None = None,
                 prices_url: str = PRICES_URL) -> list[Offer]:
    """Every VM size offered to the subscription in `regions` (all if None), priced from the Retail Prices API.

    Sizes come from resource SKUs (vCPUs, memory, GPUs; sizes restricted for the subscription are
    left out); Linux on-demand and spot prices from the public retail price list. A size with no
    on-demand price is left out.
    """
    provider = provider or AzureProvider()
    compute = provider._client("compute")
    sizes: dict[tuple[str, str], Any] = {}
    try:
        for sku in compute.resource_skus.list():
            if sku.resource_type != "virtualMachines":
                continue
            restricted = {loc for r in sku.restrictions or [] if r.type == "Location"
                          for loc in r.values_property or []}
            for location in sku.locations or []:
                if location not in restricted and (not regions or location in regions):
                    sizes[(sku.name, location)] = sku
    except Exception as err:
        raise _provider_error(err, "listing resource SKUs", zonal=False) from None
    offers = []
    for region in sorted({region for _, region in sizes}):
        prices = _retail_prices(region, prices_url, provider._verify, provider.rpc_timeout_s)
        for (name, location), sku in sorted(sizes.items()):
            if location != region or (name, False) not in prices:
                continue
            caps = {c.name: c.value for c in sku.capabilities or []}
            gpus = int(float(caps.get("GPUs", 0)))
            accelerator, memory = _gpu(name) if gpus else (None, 0.0)
            if gpus and accelerator is None:  # a GPU tfsn cannot name would be planned as a CPU VM
                continue
            offers.append(Offer(provider=PROVIDER, region=region, zone=None, instance_type=name,
                                accelerator=accelerator, accelerator_count=gpus,
                                accelerator_memory_gib=float(memory), vcpus=float(caps.get("vCPUs", 0)),
                                memory_gib=float(caps.get("MemoryGB", 0)), price=prices[(name, False)],
                                spot_price=prices.get((name, True))))
    return offers


def _gpu(size: str) -> tuple[str | None, float]:
    for pattern, accelerator in GPU_SIZES:
        if re.search(pattern, size):
            return accelerator, ACCELERATOR_MEMORY_GIB.get(accelerator, 0.0)
    return None, 0.0


def _retail_prices(region: str, url: str, verify: str | bool, timeout: float) -> dict[tuple[str, bool], float]:
    """(size, spot) -> $/hour of Linux VMs in one region, following NextPageLink."""
    requests = import_sdk("requests", provider=PROVIDER, extra="azure")
    query = {"$filter": f"serviceName eq 'Virtual Machines' and priceType eq 'Consumption' "
                        f"and armRegionName eq '{region}'"}
    prices: dict[tuple[str, bool], float] = {}
    next_url: str | None = url
    while next_url:
        page = _get_json(requests, next_url, query if next_url == url else None, verify, timeout)
        for item in page.get("Items", []):
            sku_name = item.get("skuName", "")
            if ("Windows" in item.get("productName", "") or "Low Priority" in sku_name
                    or item.get("type") != "Consumption" or item.get("unitOfMeasure") != "1 Hour"):
                continue
            prices[(item["armSkuName"], sku_name.endswith(" Spot"))] = float(item["retailPrice"])
        next_url = page.get("NextPageLink")
    return prices


def _get_json(requests: Any, url: str, params: dict | None, verify: str | bool, timeout: float,
              attempts: int = 5) -> dict:
    """GET with a timeout and bounded retries (with backoff, honouring Retry-After) on 429 and 5xx."""
    problem = ""
    for attempt in range(attempts):
        delay = min(2.0 ** attempt, 30.0)
        try:
            response = requests.get(url, params=params, verify=verify, timeout=(10, timeout))
        except requests.RequestException as err:
            problem = f"{type(err).__name__}: {err}"
        else:
            if response.status_code == 200:
                return response.json()
            problem = f"HTTP {response.status_code}: {response.text[:200]}"
            if response.status_code != 429 and response.status_code < 500:
                break
            delay = max(delay, float(response.headers.get("Retry-After") or 0))
        if attempt + 1 < attempts:
            time.sleep(delay)
    raise ProviderError(f"azure: retail prices from {url}: {problem}. To fix: retry later", provider=PROVIDER)
