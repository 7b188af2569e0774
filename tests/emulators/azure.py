"""An emulator of the Azure Resource Manager calls tfsn's Azure driver makes, and of the Retail Prices API.

Served over https (azure-core sends bearer tokens over TLS only); `ca_path` is the CA a client
must trust. Shapes follow the ARM REST reference (Microsoft.Network virtualNetworks and
networkInterfaces, Microsoft.Compute virtualMachines and skus: get, put, delete, and list in a
resource group) and
https://learn.microsoft.com/rest/api/cost-management/retail-prices/azure-retail-prices.
Long-running PUTs and DELETEs answer the way ARM does: 201/202 with an `Azure-AsyncOperation`
URL whose status is InProgress for `pending_polls` polls, then Succeeded (or Failed, with the
error a test injected with `fail_next_operation`). A VM's user-assigned identities must be ones
`add_identity` made that the caller may assign, as ARM checks them; the VM reports each with its
principal and client ids.
"""
from __future__ import annotations

import base64
import itertools
from urllib.parse import quote

from tests.emulators._http import HttpEmulator, Request, Response

SUB = r"/subscriptions/(?P<sub>[^/]+)"
RG = SUB + r"/resourceGroups/(?P<rg>[^/]+)/providers"

# The resource SKUs the emulator lists: (name, vCPUs, memory GB, GPUs, locations, zones, restricted in).
SKUS = [
    ("Standard_NC24ads_A100_v4", 24, 220, 1, ["eastus", "westeurope"], ["1", "2", "3"], ["westeurope"]),
    ("Standard_ND96isr_H100_v5", 96, 1900, 8, ["eastus"], ["1", "2"], []),
    ("Standard_NC4as_T4_v3", 4, 28, 1, ["eastus", "westeurope"], ["1"], []),
    ("Standard_D4s_v5", 4, 16, 0, ["eastus"], ["1", "2", "3"], []),
]
# Retail prices: (armSkuName, region, on-demand $/h, spot $/h).
PRICES = [
    ("Standard_NC24ads_A100_v4", "eastus", 3.673, 0.9549), ("Standard_ND96isr_H100_v5", "eastus", 98.32, 29.496),
    ("Standard_NC4as_T4_v3", "eastus", 0.526, 0.1052), ("Standard_NC4as_T4_v3", "westeurope", 0.584, 0.1168),
    ("Standard_D4s_v5", "eastus", 0.192, 0.0384),
]


def arm_error(code: str, message: str) -> dict:
    """The JSON error body of a failed ARM request."""
    return {"error": {"code": code, "message": message}}


class AzureEmulator(HttpEmulator):
    """ARM + retail prices over https on 127.0.0.1 (see the module docstring)."""

    def __init__(self, *, resource_groups: tuple[str, ...] = ("tfsn",), prices_page_size: int = 2) -> None:
        super().__init__(tls=True)
        self.resource_groups = set(resource_groups)
        self.vnets: dict[str, dict] = {}
        self.nics: dict[str, dict] = {}
        self.vms: dict[str, dict] = {}
        self.custom_data: dict[str, str] = {}   # VM name -> its decoded customData (ARM never returns it)
        self.stopped: set[str] = set()          # VMs whose OS shut down: PowerState/stopped, still allocated
        self.identities: dict[str, dict] = {}   # user-assigned identity ID (lower case) -> principalId, clientId
        self.assignable: set[str] = set()      # the identities the caller may assign (lower case IDs)
        self.pending_polls = 0                 # polls an operation reports InProgress before it ends
        self.vm_create_polls: int | None = None   # the same for VM creations only, when set (a slow allocation)
        self.prices_page_size = prices_page_size
        self._operations: dict[str, dict] = {}
        self._operation_faults: list[tuple[str, str]] = []
        self._ids = itertools.count(1)
        for kind, name, handlers in (("Microsoft.Network", "virtualNetworks",
                                      (self._put_vnet, self._get_vnet, self._delete_vnet)),
                                     ("Microsoft.Network", "networkInterfaces",
                                      (self._put_nic, self._get_nic, self._delete_nic)),
                                     ("Microsoft.Compute", "virtualMachines",
                                      (self._put_vm, self._get_vm, self._delete_vm))):
            path = RG + f"/{kind}/{name}/(?P<name>[^/]+)"
            for method, handler in zip(("PUT", "GET", "DELETE"), handlers):
                if handler is not None:
                    self.route(method, path, self._in_group(handler))
            self.route("GET", RG + f"/{kind}/{name}", self._in_group(
                lambda req, name=name: Response(200, {"value": list(self._collection(name).values())})))
        self.route("GET", SUB + r"/providers/(?P<ns>[^/]+)/locations/(?P<loc>[^/]+)/operations/(?P<op>[^/]+)",
                   self._get_operation)
        self.route("GET", SUB + r"/providers/Microsoft.Compute/skus", self._skus)
        self.route("GET", r"/api/retail/prices", self._prices)

    # -- what a test controls ------------------------------------------------------------------

    def fail_next_operation(self, code: str, message: str) -> None:
        """Make the next VM creation end Failed with this error (the VM stays, provisioningState Failed)."""
        self._operation_faults.append((code, message))

    def add_identity(self, resource_id: str, *, assignable: bool = True) -> None:
        """A user-assigned managed identity; `assignable`: the caller holds its assign action (Managed Identity
        Operator)."""
        n = next(self._ids)
        self.identities[resource_id.lower()] = {"principalId": f"{n:08x}-2222-4222-8222-222222222222",
                                                "clientId": f"{n:08x}-3333-4333-8333-333333333333"}
        if assignable:
            self.assignable.add(resource_id.lower())

    def evict(self, name: str) -> None:
        """What a spot VM with evictionPolicy Delete goes through: it is gone, with its NIC."""
        self._remove_vm(name)

    # -- plumbing ------------------------------------------------------------------------------

    def _collection(self, name: str) -> dict[str, dict]:
        return {"virtualNetworks": self.vnets, "networkInterfaces": self.nics, "virtualMachines": self.vms}[name]

    def _in_group(self, handler):
        def checked(req: Request) -> Response:
            if req.match["rg"] not in self.resource_groups:
                return Response(404, arm_error("ResourceGroupNotFound",
                                               f"Resource group '{req.match['rg']}' could not be found."))
            return handler(req)
        return checked

    def _lro(self, req: Request, status: int, body: dict | None, location: str, namespace: str,
             on_success=None, failure: tuple[str, str] | None = None, on_failure=None,
             polls: int | None = None) -> Response:
        """Start an operation and answer with its Azure-AsyncOperation URL."""
        op_id = f"{next(self._ids):08x}-0000-4000-8000-000000000000"
        polls = self.pending_polls if polls is None else polls
        self._operations[op_id] = {"polls_left": polls, "on_success": on_success,
                                   "failure": failure, "on_failure": on_failure, "status": "InProgress"}
        url = (f"{self.url}/subscriptions/{req.match['sub']}/providers/{namespace}/locations/{location}"
               f"/operations/{op_id}?api-version={req.query.get('api-version', '')}")
        headers = {"Azure-AsyncOperation": url}
        if req.method == "DELETE":
            headers["Location"] = url
        if polls == 0:
            self._advance(op_id)
        return Response(status, body, headers)

    def _advance(self, op_id: str) -> None:
        op = self._operations[op_id]
        if op["status"] != "InProgress":
            return
        if op["polls_left"] > 0:
            op["polls_left"] -= 1
            return
        if op["failure"]:
            op["status"] = "Failed"
            if op["on_failure"]:
                op["on_failure"]()
        else:
            op["status"] = "Succeeded"
            if op["on_success"]:
                op["on_success"]()

    def _get_operation(self, req: Request) -> Response:
        op = self._operations.get(req.match["op"])
        if op is None:
            return Response(404, arm_error("NotFound", "The operation was not found."))
        self._advance(req.match["op"])
        body = {"name": req.match["op"], "status": op["status"], "startTime": "2026-01-01T00:00:00Z"}
        if op["status"] == "Failed":
            code, message = op["failure"]
            body["error"] = {"code": code, "message": message}
        return Response(200, body)

    # -- network -------------------------------------------------------------------------------

    def _put_vnet(self, req: Request) -> Response:
        body = req.body or {}
        subnets = [{**s, "id": f"{req.path}/subnets/{s['name']}",
                    "properties": {**s.get("properties", {}), "provisioningState": "Succeeded"}}
                   for s in body.get("properties", {}).get("subnets", [])]
        vnet = {**body, "id": req.path, "name": req.match["name"], "type": "Microsoft.Network/virtualNetworks",
                "properties": {**body.get("properties", {}), "subnets": subnets, "provisioningState": "Succeeded"}}
        created = req.match["name"] not in self.vnets
        self.vnets[req.match["name"]] = vnet
        return self._lro(req, 201 if created else 200, vnet, body.get("location", ""), "Microsoft.Network")

    def _get_vnet(self, req: Request) -> Response:
        vnet = self.vnets.get(req.match["name"])
        if vnet is None:
            return Response(404, arm_error("ResourceNotFound", f"The Resource '{req.path}' was not found."))
        return Response(200, vnet)

    def _delete_vnet(self, req: Request) -> Response:
        name = req.match["name"]
        if name not in self.vnets:
            return Response(204)
        subnets = {s["id"].lower() for s in self.vnets[name]["properties"]["subnets"]}
        users = [nic for nic, body in self.nics.items() if subnets & {
            c.get("properties", {}).get("subnet", {}).get("id", "").lower()
            for c in body.get("properties", {}).get("ipConfigurations", [])}]
        if users:
            return Response(400, arm_error("InUseSubnetCannotBeDeleted", f"Subnet nodes is in use by "
                                           f"networkInterfaces/{users[0]} and cannot be deleted."))
        return self._lro(req, 202, None, self.vnets[name].get("location", ""), "Microsoft.Network",
                         on_success=lambda: self.vnets.pop(name, None))

    def _put_nic(self, req: Request) -> Response:
        body = req.body or {}
        configs = body.get("properties", {}).get("ipConfigurations", [])
        subnet_ids = {s["id"] for v in self.vnets.values() for s in v["properties"]["subnets"]}
        if not configs or any(c.get("properties", {}).get("subnet", {}).get("id") not in subnet_ids for c in configs):
            return Response(400, arm_error("InvalidRequestFormat", "Cannot parse the request: the NIC's subnet "
                                           "does not exist."))
        nic = {**body, "id": req.path, "name": req.match["name"], "type": "Microsoft.Network/networkInterfaces",
               "properties": {**body.get("properties", {}), "provisioningState": "Succeeded"}}
        created = req.match["name"] not in self.nics
        self.nics[req.match["name"]] = nic
        return self._lro(req, 201 if created else 200, nic, body.get("location", ""), "Microsoft.Network")

    def _get_nic(self, req: Request) -> Response:
        nic = self.nics.get(req.match["name"])
        if nic is None:
            return Response(404, arm_error("ResourceNotFound", f"The Resource '{req.path}' was not found."))
        return Response(200, nic)

    def _delete_nic(self, req: Request) -> Response:
        name = req.match["name"]
        if name not in self.nics:
            return Response(204)
        users = [vm for vm, body in self.vms.items() if _nic_ids(body) & {self.nics[name]["id"].lower()}]
        if users:
            return Response(400, arm_error("NicInUse", f"Network Interface {req.path} is used by existing resource "
                                                       f"virtualMachines/{users[0]}."))
        return self._lro(req, 202, None, self.nics[name].get("location", ""), "Microsoft.Network",
                         on_success=lambda: self.nics.pop(name, None))

    # -- compute -------------------------------------------------------------------------------

    def _put_vm(self, req: Request) -> Response:
        body = req.body or {}
        name = req.match["name"]
        invalid = self._validate_vm(body)
        if invalid:
            return Response(400, arm_error("InvalidParameter", invalid))
        if name in self.vms:
            return Response(409, arm_error("PropertyChangeNotAllowed",
                                           "Changing property 'customData' is not allowed."))
        refused = self._identity_problem(req, body)
        if refused is not None:
            return refused
        vm = {**body, "id": req.path, "name": name, "type": "Microsoft.Compute/virtualMachines",
              "properties": {**body["properties"], "provisioningState": "Creating",
                             "vmId": f"{next(self._ids):08x}-1111-4111-8111-111111111111"}}
        vm["properties"]["osProfile"] = {k: v for k, v in vm["properties"]["osProfile"].items() if k != "customData"}
        if "identity" in body:   # ARM reports each user-assigned identity with its principal and client ids
            vm["identity"] = {"type": body["identity"]["type"], "userAssignedIdentities": {
                key: self.identities[key.lower()] for key in body["identity"].get("userAssignedIdentities", {})}}
        self.vms[name] = vm
        self.custom_data[name] = base64.b64decode(body["properties"]["osProfile"]["customData"]).decode()
        failure = self._operation_faults.pop(0) if self._operation_faults else None
        return self._lro(req, 201, vm, body["location"], "Microsoft.Compute", failure=failure,
                         on_success=lambda: vm["properties"].update(provisioningState="Succeeded"),
                         on_failure=lambda: vm["properties"].update(provisioningState="Failed"),
                         polls=self.vm_create_polls)

    def _identity_problem(self, req: Request, body: dict) -> Response | None:
        """ARM's checks of a VM's user-assigned identities: the caller's assign action on each (403
        LinkedAuthorizationFailed), then that each exists (400 FailedIdentityOperation)."""
        identity = body.get("identity") or {}
        if identity and identity.get("type") not in ("UserAssigned", "SystemAssigned", "SystemAssigned, UserAssigned",
                                                      "None"):
            return Response(400, arm_error("InvalidParameter", f"The value {identity.get('type')!r} of parameter "
                                                               "'identity.type' is invalid."))
        for key in identity.get("userAssignedIdentities") or {}:
            if key.lower() in self.identities and key.lower() not in self.assignable:
                return Response(403, arm_error("LinkedAuthorizationFailed", (
                    "The client 'ci' with object id '00000000-0000-4000-8000-00000000c1c1' has permission to perform "
                    f"action 'Microsoft.Compute/virtualMachines/write' on scope '{req.path}'; however, it does not "
                    "have permission to perform action 'Microsoft.ManagedIdentity/userAssignedIdentities/assign/"
                    f"action' on the linked scope(s) '{key}' or the linked scope(s) are invalid.")))
            if key.lower() not in self.identities:
                return Response(400, arm_error("FailedIdentityOperation", (
                    f"Identity operation for resource '{req.path}' failed with error 'Failed to perform resource "
                    "identity operation. Status: 'BadRequest'. Response: '{\"error\":{\"code\":\"BadRequest\","
                    f"\"message\":\"Resource '{key}' was not found.\"}}}}'.'.")))
        return None

    def _validate_vm(self, body: dict) -> str | None:
        """The checks ARM makes that a driver bug would trip."""
        props = body.get("properties") or {}
        if not body.get("location"):
            return "The value of parameter location is invalid."
        if not props.get("hardwareProfile", {}).get("vmSize"):
            return "Required parameter 'hardwareProfile.vmSize' is missing (null)."
        nic_ids = {n["id"].lower() for n in self.nics.values()}
        if not _nic_ids(body) or not _nic_ids(body) <= nic_ids:
            return "Required parameter 'networkProfile.networkInterfaces' is missing or names an unknown NIC."
        os_profile = props.get("osProfile") or {}
        linux = os_profile.get("linuxConfiguration") or {}
        if not os_profile.get("adminPassword") and not linux.get("ssh", {}).get("publicKeys"):
            return "Either an admin password or an SSH public key is required for a Linux VM."
        try:
            base64.b64decode(os_profile.get("customData", ""), validate=True)
        except ValueError:
            return "Custom data in OSProfile must be in Base64 encoding."
        if props.get("priority") == "Spot" and not props.get("evictionPolicy"):
            return "Eviction policy is required for Spot priority virtual machines."
        return None

    def _get_vm(self, req: Request) -> Response:
        vm = self.vms.get(req.match["name"])
        if vm is None:
            return Response(404, arm_error("ResourceNotFound",
                                           f"The Resource 'Microsoft.Compute/virtualMachines/{req.match['name']}' "
                                           f"under resource group '{req.match['rg']}' was not found."))
        if req.query.get("$expand") != "instanceView":
            return Response(200, vm)
        state = vm["properties"]["provisioningState"]
        power = {"Succeeded": "running", "Creating": "starting"}.get(state, "stopped")
        if req.match["name"] in self.stopped:
            power = "stopped"
        view = {"statuses": [{"code": f"ProvisioningState/{state.lower()}", "level": "Info"},
                             {"code": f"PowerState/{power}", "level": "Info"}]}
        return Response(200, {**vm, "properties": {**vm["properties"], "instanceView": view}})

    def _delete_vm(self, req: Request) -> Response:
        name = req.match["name"]
        if name not in self.vms:
            return Response(204)
        self.vms[name]["properties"]["provisioningState"] = "Deleting"
        return self._lro(req, 202, None, self.vms[name]["location"], "Microsoft.Compute",
                         on_success=lambda: self._remove_vm(name))

    def _remove_vm(self, name: str) -> None:
        """Delete a VM and what its deleteOption says goes with it (the NIC)."""
        vm = self.vms.pop(name)
        self.stopped.discard(name)
        for ref in vm["properties"]["networkProfile"]["networkInterfaces"]:
            if ref.get("properties", {}).get("deleteOption") == "Delete":
                for nic_name, nic in list(self.nics.items()):
                    if nic["id"].lower() == ref["id"].lower():
                        del self.nics[nic_name]

    def _skus(self, req: Request) -> Response:
        wanted = req.query.get("$filter", "")
        items = []
        for name, cpus, mem, gpus, locations, zones, restricted in SKUS:
            for location in locations:
                if wanted and f"location eq '{location}'" not in wanted:
                    continue
                capabilities = [{"name": "vCPUs", "value": str(cpus)}, {"name": "MemoryGB", "value": str(mem)},
                                {"name": "LowPriorityCapable", "value": "True"}]
                if gpus:
                    capabilities.append({"name": "GPUs", "value": str(gpus)})
                restrictions = ([{"type": "Location", "values": [location], "reasonCode": "NotAvailableForSubscription",
                                  "restrictionInfo": {"locations": [location]}}] if location in restricted else [])
                items.append({"resourceType": "virtualMachines", "name": name, "tier": "Standard",
                              "size": name.removeprefix("Standard_"), "locations": [location],
                              "locationInfo": [{"location": location, "zones": zones}],
                              "capabilities": capabilities, "restrictions": restrictions})
        items.append({"resourceType": "disks", "name": "Premium_LRS", "locations": ["eastus"], "capabilities": []})
        return Response(200, {"value": items})

    def _prices(self, req: Request) -> Response:
        """Items matching `field eq 'value'` clauses joined by `and`, a page at a time via NextPageLink."""
        clauses = dict(_parse_clause(c) for c in req.query.get("$filter", "").split(" and ") if c)
        items = []
        for sku, region, price, spot in PRICES:
            for suffix, value in (("", price), (" Spot", spot), (" Low Priority", spot)):
                short = sku.removeprefix("Standard_").replace("_", " ")
                items.append({"currencyCode": "USD", "retailPrice": value, "unitPrice": value, "armRegionName": region,
                              "location": region, "meterName": f"{short}{suffix}", "skuName": f"{short}{suffix}",
                              "productName": f"Virtual Machines {short.split()[0]} Series", "armSkuName": sku,
                              "serviceName": "Virtual Machines", "serviceFamily": "Compute", "unitOfMeasure": "1 Hour",
                              "type": "Consumption", "priceType": "Consumption", "isPrimaryMeterRegion": True})
            items.append({**items[-3], "productName": items[-3]["productName"] + " Windows", "retailPrice": price * 2})
            items.append({**items[-4], "type": "Reservation", "priceType": "Reservation", "retailPrice": price * 0.6,
                          "reservationTerm": "1 Year"})
        items = [i for i in items if all(str(i.get(k)) == v for k, v in clauses.items())]
        skip = int(req.query.get("$skip") or 0)
        page = items[skip:skip + self.prices_page_size]
        next_link = None
        if skip + self.prices_page_size < len(items):
            next_link = (f"{self.url}/api/retail/prices?$filter={quote(req.query.get('$filter', ''))}"
                         f"&$skip={skip + self.prices_page_size}")
        return Response(200, {"BillingCurrency": "USD", "CustomerEntityId": "Default", "CustomerEntityType": "Retail",
                              "Items": page, "NextPageLink": next_link, "Count": len(page)})


def _parse_clause(clause: str) -> tuple[str, str]:
    field, op, value = clause.strip().split(" ", 2)
    assert op == "eq", f"the emulator understands only 'eq' filters, got {clause!r}"
    return field, value.strip("'")


def _nic_ids(vm: dict) -> set[str]:
    refs = vm.get("properties", {}).get("networkProfile", {}).get("networkInterfaces", [])
    return {r.get("id", "").lower() for r in refs}
