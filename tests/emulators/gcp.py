"""An emulator of the Compute Engine v1 REST API: the calls tfsn's GCP driver makes.

Shapes follow https://cloud.google.com/compute/docs/reference/rest/v1 (instances, zoneOperations,
regions, machineTypes.aggregatedList, acceleratorTypes.aggregatedList, instances and disks:
aggregatedList with a `labels.KEY:*` filter, disks.delete). Instances are kept by (project, zone,
name), and so are disks: an instance's boot disk is made with it (named after it, labelled with its
initializeParams' labels) and deleted with it when autoDelete says so. Inserts and deletes return
zonal Operations that finish at once or after
`pending_polls` polls. An instance's service account must be one `add_service_account` made (else its
operation fails EXTERNAL_RESOURCE_NOT_FOUND) that the caller may act as (else the insert is refused),
as Compute Engine checks them; the instance keeps it as sent (`serviceAccounts`: email and scopes). A test injects a request error with `fail_next(...)` (a `gcp_error` body)
or makes the next operation fail with `fail_next_operation(...)` (as a stockout does: the insert
is accepted, its operation ends DONE with an error).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from tests.emulators._http import HttpEmulator, Request, Response

API = "https://www.googleapis.com/compute/v1"
NAME_RE = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
LABEL_VALUE_RE = re.compile(r"[-_a-z0-9]{0,63}")
PREFIX = r"/compute/v1/projects/(?P<project>[^/]+)"

# The default inventory: zone -> machine types (name, vCPUs, memory MB, built-in accelerators)
# and attachable accelerator types (name, description, most cards per instance).
MACHINE_TYPES = {
    "us-central1-a": [("n1-standard-8", 8, 30720, None), ("n1-standard-16", 16, 61440, None),
                      ("e2-standard-4", 4, 16384, None), ("a2-highgpu-1g", 12, 87040, ("nvidia-tesla-a100", 1)),
                      ("a3-highgpu-8g", 208, 1916928, ("nvidia-h100-80gb", 8))],
    "us-central1-b": [("n1-standard-8", 8, 30720, None), ("g2-standard-8", 8, 32768, ("nvidia-l4", 1))],
    "europe-west4-a": [("n1-standard-8", 8, 30720, None)],
}
ACCELERATOR_TYPES = {
    "us-central1-a": [("nvidia-tesla-t4", "NVIDIA T4", 4), ("nvidia-tesla-a100", "NVIDIA A100 40GB", 16),
                      ("nvidia-h100-80gb", "NVIDIA H100 80GB", 8)],
    "us-central1-b": [("nvidia-tesla-t4", "NVIDIA T4", 4), ("nvidia-l4", "NVIDIA L4", 8)],
    "europe-west4-a": [("nvidia-tesla-v100", "NVIDIA V100", 8)],
}

# Cloud Billing Catalog SKUs of Compute Engine: (description, usage type, regions, USD per unit).
BILLING_SKUS = [
    ("N1 Predefined Instance Core running in Americas", "OnDemand", ["us-central1"], 0.031611),
    ("N1 Predefined Instance Ram running in Americas", "OnDemand", ["us-central1"], 0.004237),
    ("Spot Preemptible N1 Predefined Instance Core running in Americas", "Preemptible", ["us-central1"], 0.00698),
    ("Spot Preemptible N1 Predefined Instance Ram running in Americas", "Preemptible", ["us-central1"], 0.000936),
    ("N1 Predefined Instance Core running in EMEA", "OnDemand", ["europe-west4"], 0.034806),
    ("N1 Predefined Instance Ram running in EMEA", "OnDemand", ["europe-west4"], 0.004665),
    ("Commitment v1: N1 Predefined Instance Core in Americas for 1 Year", "Commit1Yr", ["us-central1"], 0.019915),
    ("Nvidia Tesla T4 GPU running in Americas", "OnDemand", ["us-central1"], 0.35),
    ("Spot Preemptible Nvidia Tesla T4 GPU running in Americas", "Preemptible", ["us-central1"], 0.07),
    ("A2 Instance Core running in Americas", "OnDemand", ["us-central1"], 0.031611),
    ("A2 Instance Ram running in Americas", "OnDemand", ["us-central1"], 0.004237),
    ("Nvidia Tesla A100 GPU running in Americas", "OnDemand", ["us-central1"], 2.933908),
    ("DWS Defined Duration Nvidia Tesla A100 GPU running in Americas", "OnDemand", ["us-central1"], 1.5),
]


def gcp_error(code: int, message: str, reason: str, status: str = "") -> dict:
    """The JSON error body of a failed Compute Engine request."""
    return {"error": {"code": code, "message": message, "status": status,
                      "errors": [{"message": message, "domain": "global", "reason": reason}]}}


@dataclass
class _Operation:
    body: dict
    polls_left: int
    on_done: list = field(default_factory=list)   # callbacks run when the operation finishes


class GcpEmulator(HttpEmulator):
    """Compute Engine v1 over http on 127.0.0.1 (see the module docstring)."""

    def __init__(self, *, page_size: int = 2) -> None:
        super().__init__()
        self.instances: dict[tuple[str, str, str], dict] = {}
        self.disks: dict[tuple[str, str, str], dict] = {}
        self.operations: dict[str, _Operation] = {}
        self.service_accounts: dict[str, set[str]] = {}   # project -> the emails of its service accounts
        self.may_act_as: set[str] = set()                 # the service accounts the caller may attach
        self.pending_polls = 0            # polls an operation stays RUNNING before it is DONE
        self.page_size = page_size        # zones per page of an aggregated list
        self._operation_faults: list[tuple[str, str, int]] = []
        self._ids = itertools.count(1000000000000000001)
        z = PREFIX + r"/zones/(?P<zone>[^/]+)"
        self.route("POST", z + r"/instances", self._insert)
        self.route("GET", z + r"/instances/(?P<name>[^/]+)", self._get)
        self.route("DELETE", z + r"/instances/(?P<name>[^/]+)", self._delete)
        self.route("GET", z + r"/operations/(?P<operation>[^/]+)", self._get_operation)
        self.route("DELETE", z + r"/disks/(?P<name>[^/]+)", self._delete_disk)
        self.route("GET", PREFIX + r"/aggregated/instances", lambda req: self._listed(req, "instance", self.instances))
        self.route("GET", PREFIX + r"/aggregated/disks", lambda req: self._listed(req, "disk", self.disks))
        self.route("GET", PREFIX + r"/regions/(?P<region>[^/]+)", self._get_region)
        self.route("GET", PREFIX + r"/aggregated/machineTypes", self._machine_types)
        self.route("GET", PREFIX + r"/aggregated/acceleratorTypes", self._accelerator_types)
        self.route("GET", r"/v1/services/(?P<service>[^/]+)/skus", self._billing_skus)

    # -- what a test controls ------------------------------------------------------------------

    def fail_next_operation(self, code: str, message: str, http_status: int = 503) -> None:
        """Make the next insert's operation end DONE with this error (and no instance)."""
        self._operation_faults.append((code, message, http_status))

    def add_service_account(self, project: str, email: str, *, usable: bool = True) -> None:
        """A service account of the project; `usable`: the caller holds iam.serviceAccountUser on it."""
        self.service_accounts.setdefault(project, set()).add(email)
        if usable:
            self.may_act_as.add(email)

    def set_status(self, project: str, zone: str, name: str, status: str) -> None:
        self.instances[(project, zone, name)]["status"] = status

    def preempt(self, project: str, zone: str, name: str) -> None:
        """What a spot VM with instanceTerminationAction DELETE goes through: it is gone."""
        self._remove_instance((project, zone, name))

    def add_disk(self, project: str, zone: str, name: str, labels: dict[str, str]) -> None:
        """A disk no instance uses (left by an instance deleted without it)."""
        self.disks[(project, zone, name)] = {"kind": "compute#disk", "id": str(next(self._ids)), "name": name,
                                             "zone": f"{API}/projects/{project}/zones/{zone}", "labels": labels,
                                             "status": "READY", "sizeGb": "200"}

    # -- handlers ------------------------------------------------------------------------------

    def _operation(self, project: str, zone: str, kind: str, target: str, on_done=None,
                   error: tuple[str, str, int] | None = None) -> Response:
        name = f"operation-{next(self._ids)}-{kind}"
        body = {"kind": "compute#operation", "id": str(next(self._ids)), "name": name,
                "zone": f"{API}/projects/{project}/zones/{zone}", "operationType": kind,
                "targetLink": f"{API}/projects/{project}/zones/{zone}/instances/{target}",
                "status": "RUNNING", "progress": 0, "insertTime": "2026-01-01T00:00:00.000-07:00",
                "selfLink": f"{API}/projects/{project}/zones/{zone}/operations/{name}"}
        op = _Operation(body, self.pending_polls, [on_done] if on_done else [])
        if error is not None:
            code, message, status = error
            op.on_done = [lambda: body.update(error={"errors": [{"code": code, "message": message}]},
                                              httpErrorStatusCode=status,
                                              httpErrorMessage=_STATUS_TEXT.get(status, "ERROR"))]
        self.operations[name] = op
        self._advance(op)
        return Response(200, dict(body))

    def _advance(self, op: _Operation) -> None:
        if op.body["status"] == "DONE":
            return
        if op.polls_left > 0:
            op.polls_left -= 1
            return
        for callback in op.on_done:
            callback()
        op.body.update(status="DONE", progress=100, endTime="2026-01-01T00:00:05.000-07:00")

    def _insert(self, req: Request) -> Response:
        project, zone = req.match["project"], req.match["zone"]
        body = req.body or {}
        name = body.get("name", "")
        invalid = self._validate(zone, body)
        if invalid:
            return Response(400, gcp_error(400, invalid, "invalid", "INVALID_ARGUMENT"))
        key = (project, zone, name)
        if key in self.instances:
            message = f"The resource 'projects/{project}/zones/{zone}/instances/{name}' already exists"
            return Response(409, gcp_error(409, message, "alreadyExists", "ALREADY_EXISTS"))
        missing = self._service_account_problem(project, body)
        if isinstance(missing, Response):
            return missing
        if missing or self._operation_faults:
            return self._operation(project, zone, "insert", name, error=missing or self._operation_faults.pop(0))
        instance = {**body, "kind": "compute#instance", "id": str(next(self._ids)), "status": "PROVISIONING",
                    "zone": f"{API}/projects/{project}/zones/{zone}",
                    "creationTimestamp": "2026-01-01T00:00:00.000-07:00",
                    "selfLink": f"{API}/projects/{project}/zones/{zone}/instances/{name}"}
        self.instances[key] = instance
        for disk in body.get("disks") or []:
            params = disk.get("initializeParams") or {}
            disk_key = (project, zone, params.get("diskName") or name)
            self.add_disk(*disk_key, labels=params.get("labels", {}))
            self.disks[disk_key]["users"] = [instance["selfLink"]]
            disk["source"] = f"{API}/projects/{project}/zones/{zone}/disks/{disk_key[2]}"
        return self._operation(project, zone, "insert", name,
                               on_done=lambda: instance.update(status="RUNNING") if instance["status"] ==
                               "PROVISIONING" else None)

    def _validate(self, zone: str, body: dict) -> str | None:
        """The checks Compute Engine makes that a driver bug would trip."""
        name = body.get("name", "")
        if not NAME_RE.fullmatch(name):
            return f"Invalid value for field 'resource.name': '{name}'. Must be a match of regex '{NAME_RE.pattern}'"
        for key, value in (body.get("labels") or {}).items():
            if not LABEL_VALUE_RE.fullmatch(value):
                return f"Invalid value for field 'resource.labels': '{key}={value}'"
        machine = body.get("machineType", "").rsplit("/", 1)[-1]
        if machine not in {m[0] for m in MACHINE_TYPES.get(zone, [])}:
            return (f"Invalid value for field 'resource.machineType': '{body.get('machineType')}'. "
                    f"Machine type with name '{machine}' does not exist in zone '{zone}'.")
        scheduling = body.get("scheduling") or {}
        if body.get("guestAccelerators") and scheduling.get("onHostMaintenance", "MIGRATE") == "MIGRATE":
            return "Instances with guest accelerators do not support live migration."
        if scheduling.get("provisioningModel") == "SPOT" and scheduling.get("automaticRestart", True):
            return "Invalid value for field 'resource.scheduling.automaticRestart': 'true'. Spot VMs cannot restart."
        if not any(d.get("boot") for d in body.get("disks") or []):
            return "Invalid value for field 'resource.disks': no boot disk"
        return None

    def _service_account_problem(self, project: str, body: dict) -> Response | tuple[str, str, int] | None:
        """What Compute Engine says of an instance's service account: one that exists but the caller may not act
        as is refused by the insert; one that does not exist fails the insert's operation."""
        for account in body.get("serviceAccounts") or []:
            email = account.get("email", "")
            if email not in self.service_accounts.get(project, set()):
                return ("EXTERNAL_RESOURCE_NOT_FOUND", f"The resource '{email}' of type 'serviceAccount' was not "
                                                       "found.", 400)
            if email not in self.may_act_as:
                message = (f"The user does not have access to service account '{email}'.  User: 'ci@{project}.iam."
                           "gserviceaccount.com'.  Ask a project owner to grant you the iam.serviceAccountUser role "
                           "on the service account")
                return Response(400, gcp_error(400, message, "badRequest", "INVALID_ARGUMENT"))
        return None

    def _get(self, req: Request) -> Response:
        key = (req.match["project"], req.match["zone"], req.match["name"])
        if key not in self.instances:
            return _not_found(*key)
        return Response(200, self.instances[key])

    def _delete(self, req: Request) -> Response:
        key = (req.match["project"], req.match["zone"], req.match["name"])
        if key not in self.instances:
            return _not_found(*key)
        self.instances[key]["status"] = "STOPPING"
        return self._operation(key[0], key[1], "delete", key[2], on_done=lambda: self._remove_instance(key))

    def _remove_instance(self, key: tuple[str, str, str]) -> None:
        """The instance is gone; its disks with autoDelete go with it, the others are left unused."""
        instance = self.instances.pop(key, None)
        for disk in (instance or {}).get("disks") or []:
            disk_key = (key[0], key[1], disk["source"].rsplit("/", 1)[-1])
            if disk.get("autoDelete"):
                self.disks.pop(disk_key, None)
            elif disk_key in self.disks:
                self.disks[disk_key]["users"] = []

    def _delete_disk(self, req: Request) -> Response:
        key = (req.match["project"], req.match["zone"], req.match["name"])
        if key not in self.disks:
            return _not_found(*key, kind="disks")
        if self.disks[key].get("users"):
            message = f"The disk resource '{req.path}' is already being used by '{self.disks[key]['users'][0]}'"
            return Response(400, gcp_error(400, message, "resourceInUseByAnotherResource", "FAILED_PRECONDITION"))
        return self._operation(key[0], key[1], "delete", key[2], on_done=lambda: self.disks.pop(key, None))

    def _listed(self, req: Request, kind: str, items: dict[tuple[str, str, str], dict]) -> Response:
        """An aggregated list of instances or disks, all in one page, filtered by `labels.KEY:*` (has the label)."""
        wanted = re.fullmatch(r"labels\.([-_a-z0-9]+):\*", req.query.get("filter", ""))
        assert wanted or not req.query.get("filter"), f"the emulator has no filter {req.query['filter']!r}"
        zones: dict[str, list[dict]] = {}
        for (project, zone, _), item in sorted(items.items()):
            if project == req.match["project"] and (not wanted or wanted[1] in (item.get("labels") or {})):
                zones.setdefault(f"zones/{zone}", []).append(item)
        return Response(200, {"kind": f"compute#{kind}AggregatedList", "items": {
            scope: {f"{kind}s": found} for scope, found in zones.items()}})

    def _get_operation(self, req: Request) -> Response:
        op = self.operations.get(req.match["operation"])
        if op is None:
            return Response(404, gcp_error(404, f"The resource '{req.path}' was not found", "notFound", "NOT_FOUND"))
        self._advance(op)
        return Response(200, op.body)

    def _get_region(self, req: Request) -> Response:
        project, region = req.match["project"], req.match["region"]
        zones = sorted(z for z in MACHINE_TYPES if z.rsplit("-", 1)[0] == region)
        if not zones:
            return Response(404, gcp_error(404, f"The resource 'projects/{project}/regions/{region}' was not found",
                                           "notFound", "NOT_FOUND"))
        return Response(200, {"kind": "compute#region", "name": region, "status": "UP",
                              "zones": [f"{API}/projects/{project}/zones/{z}" for z in zones]})

    def _aggregated(self, req: Request, kind: str, field_name: str, rows: dict[str, list[dict]]) -> Response:
        """One page of an aggregated list: `page_size` zones a page, pageToken = index of the next zone."""
        zones = sorted(rows)
        start = int(req.query.get("pageToken") or 0)
        page = zones[start:start + self.page_size]
        body = {"kind": f"compute#{kind}AggregatedList", "id": f"projects/{req.match['project']}/aggregated/{kind}s",
                "items": {f"zones/{z}": {field_name: rows[z]} for z in page}}
        if start + self.page_size < len(zones):
            body["nextPageToken"] = str(start + self.page_size)
        return Response(200, body)

    def _machine_types(self, req: Request) -> Response:
        rows = {zone: [{"kind": "compute#machineType", "id": str(9000 + i), "name": name, "guestCpus": cpus,
                        "memoryMb": mem, "zone": zone, "description": f"{cpus} vCPUs, {mem / 1024:g} GB RAM",
                        **({"accelerators": [{"guestAcceleratorType": acc[0], "guestAcceleratorCount": acc[1]}]}
                           if acc else {})}
                       for i, (name, cpus, mem, acc) in enumerate(types)]
                for zone, types in MACHINE_TYPES.items()}
        return self._aggregated(req, "machineType", "machineTypes", rows)

    def _accelerator_types(self, req: Request) -> Response:
        rows = {zone: [{"kind": "compute#acceleratorType", "id": str(7000 + i), "name": name, "description": desc,
                        "zone": f"{API}/projects/{req.match['project']}/zones/{zone}",
                        "maximumCardsPerInstance": most}
                       for i, (name, desc, most) in enumerate(types)]
                for zone, types in ACCELERATOR_TYPES.items()}
        return self._aggregated(req, "acceleratorType", "acceleratorTypes", rows)

    def _billing_skus(self, req: Request) -> Response:
        """cloudbilling.googleapis.com/v1/services/*/skus, `page_size` SKUs a page."""
        if req.match["service"] != "6F81-5844-456A":
            return Response(404, gcp_error(404, "Service not found", "notFound", "NOT_FOUND"))
        skus = []
        for i, (description, usage, regions, price) in enumerate(BILLING_SKUS):
            kind = "GPU" if "GPU" in description else description.split(" Instance ")[-1].split()[0]
            units, nanos = int(price), round((price - int(price)) * 1e9)
            skus.append({"name": f"services/6F81-5844-456A/skus/{i:04X}-0000-0000", "skuId": f"{i:04X}-0000-0000",
                         "description": description, "serviceRegions": regions, "serviceProviderName": "Google",
                         "category": {"serviceDisplayName": "Compute Engine", "resourceFamily": "Compute",
                                      "resourceGroup": kind, "usageType": usage},
                         "pricingInfo": [{"effectiveTime": "2026-01-01T00:00:00Z", "pricingExpression": {
                             "usageUnit": "GiBy.h" if kind == "Ram" else "h", "displayQuantity": 1,
                             "baseUnitConversionFactor": 3600,
                             "tieredRates": [{"startUsageAmount": 0, "unitPrice": {
                                 "currencyCode": "USD", "units": str(units), "nanos": nanos}}]},
                             "currencyConversionRate": 1}]})
        start = int(req.query.get("pageToken") or 0)
        body = {"skus": skus[start:start + 3 * self.page_size]}
        if start + 3 * self.page_size < len(skus):
            body["nextPageToken"] = str(start + 3 * self.page_size)
        return Response(200, body)


_STATUS_TEXT = {400: "BAD REQUEST", 403: "FORBIDDEN", 404: "NOT FOUND", 503: "SERVICE UNAVAILABLE"}


def _not_found(project: str, zone: str, name: str, kind: str = "instances") -> Response:
    message = f"The resource 'projects/{project}/zones/{zone}/{kind}/{name}' was not found"
    return Response(404, gcp_error(404, message, "notFound", "NOT_FOUND"))
