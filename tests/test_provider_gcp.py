"""The GCP driver through the real google-cloud-compute client, over HTTP, against the local emulator."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("google.cloud.compute_v1")

from google.auth.credentials import AnonymousCredentials  # noqa: E402

from providers.base import (AuthError, CapacityError, InvalidRequestError, NodeHandle, NodeRequest,  # noqa: E402
                            NodeStatus, NotFoundError, Offer, QuotaError)
from providers.gcp import GcpProvider, fetch_offers  # noqa: E402
from tests.emulators.gcp import GcpEmulator, gcp_error  # noqa: E402

PROJECT = "tfsn-test"


@pytest.fixture
def emulator():
    with GcpEmulator() as server:
        yield server


def make_provider(emulator: GcpEmulator, **options) -> GcpProvider:
    settings = {"poll_interval_s": 0.01, "operation_timeout_s": 5.0, "rpc_timeout_s": 5.0, **options}
    return GcpProvider(PROJECT, credentials=AnonymousCredentials(), api_endpoint=emulator.url, **settings)


@pytest.fixture
def gcp(emulator):
    return make_provider(emulator)


def offer(instance_type="n1-standard-8", accelerator="T4", count=1, zone="us-central1-a") -> Offer:
    return Offer(provider="gcp", region="us-central1", zone=zone, instance_type=instance_type,
                 accelerator=accelerator, accelerator_count=count, accelerator_memory_gib=16.0, vcpus=8,
                 memory_gib=30, price=1.0, spot_price=0.3)


def request(node_id="job-7-n0-ab12", spot=False, **offer_fields) -> NodeRequest:
    return NodeRequest(job_id="7", node_id=node_id, command=["python3", "-m", "orchestrator.agent"],
                       env={"TFSN_NODE_ID": node_id}, workdir="/opt/tfsn", offer=offer(**offer_fields), spot=spot)


def instance(emulator: GcpEmulator, handle: NodeHandle) -> dict:
    return emulator.instances[(PROJECT, handle.data["zone"], handle.data["name"])]


def metadata(body: dict) -> dict:
    return {item["key"]: item["value"] for item in body["metadata"]["items"]}


def test_provision_creates_a_labelled_gpu_vm_that_runs_the_startup_script(gcp, emulator):
    handle = gcp.provision(request())
    body = instance(emulator, handle)
    assert body["name"] == "tfsn-job-7-n0-ab12"
    assert body["machineType"].endswith("zones/us-central1-a/machineTypes/n1-standard-8")
    assert body["guestAccelerators"] == [{"acceleratorType": "zones/us-central1-a/acceleratorTypes/nvidia-tesla-t4",
                                          "acceleratorCount": 1}]
    assert body["scheduling"]["onHostMaintenance"] == "TERMINATE"
    assert body["labels"] == {"tfsn-job": "7", "tfsn-node": "job-7-n0-ab12"}
    script = metadata(body)["startup-script"]
    assert script.startswith("#!/bin/bash") and "\ntrap tfsn_finish EXIT\n" in script   # powers off on any exit
    assert script.rstrip().endswith("\npython3 -m orchestrator.agent")
    assert "export TFSN_NODE_ID=job-7-n0-ab12" in script
    assert gcp.status(handle) is NodeStatus.RUNNING


def test_accelerator_optimized_machine_types_bring_their_own_gpus(gcp, emulator):
    handle = gcp.provision(request(instance_type="a2-highgpu-1g", accelerator="A100"))
    assert "guestAccelerators" not in instance(emulator, handle)


def test_spot_vm_is_deleted_on_preemption_and_then_reads_terminated(gcp, emulator):
    handle = gcp.provision(request(spot=True))
    scheduling = instance(emulator, handle)["scheduling"]
    assert scheduling["provisioningModel"] == "SPOT"
    assert scheduling["instanceTerminationAction"] == "DELETE"
    assert scheduling["automaticRestart"] is False
    emulator.preempt(PROJECT, handle.data["zone"], handle.data["name"])
    assert gcp.status(handle) is NodeStatus.TERMINATED


SERVICE_ACCOUNT = f"tfsn-node@{PROJECT}.iam.gserviceaccount.com"


def test_the_vm_runs_as_the_jobs_service_account_with_the_cloud_platform_scope(gcp, emulator):
    emulator.add_service_account(PROJECT, SERVICE_ACCOUNT)
    handle = gcp.provision(NodeRequest(**{**request().__dict__, "identity": SERVICE_ACCOUNT}))
    # As the API reports it, read back through the SDK.
    got = gcp._call("InstancesClient", "get", project=PROJECT, zone=handle.data["zone"], instance=handle.data["name"])
    assert [(a.email, list(a.scopes)) for a in got.service_accounts] == [
        (SERVICE_ACCOUNT, ["https://www.googleapis.com/auth/cloud-platform"])]


def test_no_identity_asks_for_no_service_account(gcp, emulator):
    handle = gcp.provision(request())
    assert "serviceAccounts" not in instance(emulator, handle)


@pytest.mark.parametrize("exists,error,fix", [
    (False, InvalidRequestError, "gcloud iam service-accounts create"),
    (True, AuthError, "roles/iam.serviceAccountUser"),
])
def test_a_refused_service_account_blocks_the_cloud_with_the_fix(gcp, emulator, exists, error, fix):
    """Compute Engine's answers for a service account that does not exist (the insert's operation fails) and for
    one the caller may not act as (the insert is refused): the same in every zone, so the whole cloud is blocked."""
    if exists:
        emulator.add_service_account(PROJECT, SERVICE_ACCOUNT, usable=False)
    with pytest.raises(error) as caught:
        gcp.provision(NodeRequest(**{**request().__dict__, "identity": SERVICE_ACCOUNT}))
    text = str(caught.value)
    assert caught.value.scope == "provider" and not caught.value.retryable and "\n" not in text
    assert SERVICE_ACCOUNT in text and fix in text.split("To fix:")[1] and "resources.remote_identity.gcp" in text
    assert not emulator.instances


def test_provision_twice_makes_one_vm_and_a_restarted_controller_finds_it(gcp, emulator):
    first = gcp.provision(request())
    again = gcp.provision(request())
    assert again == first
    assert emulator.count("POST", r"/instances$") == 2 and len(emulator.instances) == 1
    restored = NodeHandle(**json.loads(json.dumps(first.__dict__)))
    fresh = make_provider(emulator)
    assert fresh.status(restored) is NodeStatus.RUNNING
    fresh.terminate(restored)
    assert emulator.instances == {}
    assert fresh.status(restored) is NodeStatus.TERMINATED
    fresh.terminate(restored)  # already gone: not an error


def test_provision_waits_for_an_operation_that_takes_several_polls(gcp, emulator):
    emulator.pending_polls = 3
    handle = gcp.provision(request())
    assert emulator.count("GET", r"/operations/") == 3
    assert gcp.status(handle) is NodeStatus.RUNNING


@pytest.mark.parametrize("code", ["ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"])
def test_stockout_in_the_operation_is_a_capacity_error_for_the_zone(gcp, emulator, code):
    emulator.pending_polls = 1
    emulator.fail_next_operation(code, "The zone 'projects/tfsn-test/zones/us-central1-a' does not have enough "
                                       "resources available to fulfill the request.")
    with pytest.raises(CapacityError) as err:
        gcp.provision(request())
    assert err.value.scope == "zone" and err.value.retryable
    assert code in str(err.value) and "us-central1-a" in str(err.value)
    assert emulator.instances == {}


@pytest.mark.parametrize("message, scope", [
    ("Quota 'NVIDIA_T4_GPUS' exceeded.  Limit: 0.0 in region us-central1.", "region"),
    ("Quota 'GPUS_ALL_REGIONS' exceeded.  Limit: 0.0 globally.", "provider"),
])
def test_quota_in_the_operation_is_a_quota_error(gcp, emulator, message, scope):
    emulator.fail_next_operation("QUOTA_EXCEEDED", message, http_status=403)
    with pytest.raises(QuotaError) as err:
        gcp.provision(request())
    assert err.value.scope == scope and "QUOTA_EXCEEDED" in str(err.value) and "To fix" in str(err.value)


@pytest.mark.parametrize("status, reason, error", [
    (403, "quotaExceeded", QuotaError),
    (403, "forbidden", AuthError),
    (401, "authError", AuthError),
    (400, "invalid", InvalidRequestError),
    (404, "notFound", NotFoundError),
])
def test_refused_requests_map_to_typed_errors(gcp, emulator, status, reason, error):
    emulator.fail_next("POST", r"/instances$", status, gcp_error(status, f"refused: {reason}", reason))
    with pytest.raises(error) as err:
        gcp.provision(request())
    assert "To fix" in str(err.value)
    if status != 401:  # on a 401 the SDK first tries to refresh its token: that failure is what is reported
        assert reason in str(err.value)
    assert emulator.instances == {}


def test_throttled_insert_is_retried(gcp, emulator):
    emulator.fail_next("POST", r"/instances$", 429, gcp_error(429, "Rate Limit Exceeded", "rateLimitExceeded"))
    handle = gcp.provision(request())
    assert emulator.count("POST", r"/instances$") == 2
    assert gcp.status(handle) is NodeStatus.RUNNING


def test_an_operation_past_its_deadline_deletes_the_vm_and_fails_over(emulator):
    gcp = make_provider(emulator, operation_timeout_s=0.2)
    emulator.pending_polls = 10**6
    with pytest.raises(CapacityError) as err:
        gcp.provision(request())
    assert "not created within" in str(err.value)
    assert emulator.count("DELETE", r"/instances/tfsn-job-7-n0-ab12$") == 1


def test_an_offer_without_a_zone_goes_to_the_regions_first_zone(gcp, emulator):
    handle = gcp.provision(request(zone=None))
    assert handle.data["zone"] == "us-central1-a"


@pytest.mark.parametrize("status, expected", [("STAGING", NodeStatus.PENDING), ("RUNNING", NodeStatus.RUNNING),
                                              ("STOPPING", NodeStatus.TERMINATED), ("TERMINATED", NodeStatus.TERMINATED),
                                              ("SUSPENDED", NodeStatus.TERMINATED)])
def test_status_follows_the_instance_life_cycle(gcp, emulator, status, expected):
    handle = gcp.provision(request())
    emulator.set_status(PROJECT, handle.data["zone"], handle.data["name"], status)
    assert gcp.status(handle) is expected


def test_status_is_unknown_when_the_api_refuses(gcp, emulator):
    handle = gcp.provision(request())
    emulator.fail_next("GET", r"/instances/", 403, gcp_error(403, "denied", "forbidden"))
    assert gcp.status(handle) is NodeStatus.UNKNOWN


def test_node_ids_become_valid_distinct_instance_names(gcp, emulator):
    ids = ["My.Job_1-3-n0-ab12", "my-job-1-3-n0-ab12", "x" * 90, "x" * 91]
    handles = [gcp.provision(request(node_id=node_id)) for node_id in ids]  # the emulator checks names and labels
    assert len(emulator.instances) == 4 and gcp.provision(request(node_id=ids[0])) == handles[0]
    odd = instance(emulator, handles[0])
    assert odd["labels"]["tfsn-node"] != instance(emulator, handles[1])["labels"]["tfsn-node"]
    assert metadata(odd)["tfsn-node-id"] == "My.Job_1-3-n0-ab12"


def test_provision_needs_a_gcp_offer(gcp):
    bad = NodeRequest(job_id="7", node_id="n", command=["true"], env={}, workdir="/")
    with pytest.raises(InvalidRequestError, match="needs a planned gcp offer"):
        gcp.provision(bad)


def priced(instance_type, accelerator, count, zone, price, spot=None) -> Offer:
    """A row of the catalog snapshot (only the fields fetch_offers reads)."""
    return Offer("gcp", zone.rsplit("-", 1)[0], zone, instance_type, accelerator, count, 0, 0, 0, price, spot)


def test_fetch_offers_prices_machine_and_accelerator_types_from_the_billing_catalog(gcp, emulator):
    snapshot = [priced("g2-standard-8", "L4", 1, "us-central1-b", 0.85, 0.28),
                priced("a2-highgpu-1g", "A100", 1, "us-central1-a", 9.99, 1.44)]
    offers = fetch_offers(provider=gcp, snapshot=snapshot)
    assert emulator.count("GET", r"/aggregated/machineTypes$") == 2  # 3 zones, 2 a page
    assert emulator.count("GET", r"/skus$") == 3                    # 13 SKUs, 6 a page
    found = {(o.instance_type, o.accelerator, o.accelerator_count, o.zone): o for o in offers}
    # E2 and A3 have no billing SKUs here and no snapshot row; V100 has no billing SKU: left out.
    assert set(found) == {
        ("n1-standard-8", None, 0, "us-central1-a"), ("n1-standard-16", None, 0, "us-central1-a"),
        ("n1-standard-8", "T4", 1, "us-central1-a"), ("n1-standard-16", "T4", 2, "us-central1-a"),
        ("a2-highgpu-1g", "A100", 1, "us-central1-a"),
        ("n1-standard-8", None, 0, "us-central1-b"), ("n1-standard-8", "T4", 1, "us-central1-b"),
        ("g2-standard-8", "L4", 1, "us-central1-b"), ("n1-standard-8", None, 0, "europe-west4-a")}
    t4x2 = found[("n1-standard-16", "T4", 2, "us-central1-a")]
    assert (t4x2.vcpus, t4x2.memory_gib, t4x2.accelerator_memory_gib) == (16.0, 60.0, 16.0)
    assert t4x2.price == pytest.approx(16 * 0.031611 + 60 * 0.004237 + 2 * 0.35)       # cores + RAM + GPUs
    assert t4x2.spot_price == pytest.approx(16 * 0.00698 + 60 * 0.000936 + 2 * 0.07)
    a2 = found[("a2-highgpu-1g", "A100", 1, "us-central1-a")]
    assert a2.price == pytest.approx(12 * 0.031611 + 85 * 0.004237 + 2.933908)         # not the snapshot's 9.99
    assert a2.spot_price == 1.44 and a2.accelerator_memory_gib == 40.0                 # no spot SKU: the snapshot's
    assert found[("g2-standard-8", "L4", 1, "us-central1-b")].price == 0.85           # no G2 SKUs: the snapshot's
    europe = fetch_offers(["europe-west4"], provider=gcp, snapshot=snapshot)
    assert [(o.instance_type, o.price) for o in europe] == [("n1-standard-8", pytest.approx(8 * 0.034806 +
                                                                                           30 * 0.004665))]


def test_fetch_offers_falls_back_to_the_snapshot_when_billing_is_unreachable(gcp, emulator):
    emulator.fail_next("GET", r"/skus$", 403, gcp_error(403, "Cloud Billing API has not been used in project "
                                                             "tfsn-test before or it is disabled.", "forbidden"))
    offers = fetch_offers(provider=gcp, snapshot=[priced("n1-standard-8", "T4", 1, "us-central1-b", 0.73, 0.2)])
    # Prices are per region: the snapshot's row prices the offer in each zone of us-central1 with a T4.
    assert [(o.instance_type, o.accelerator, o.zone, o.price, o.spot_price) for o in offers] == [
        ("n1-standard-8", "T4", "us-central1-a", 0.73, 0.2), ("n1-standard-8", "T4", "us-central1-b", 0.73, 0.2)]


def test_an_instance_created_before_the_controller_recorded_it_is_found_by_its_name(gcp, emulator):
    created = gcp.provision(request())               # the answer never reached the store
    assert instance(emulator, created)
    recorded = NodeHandle("gcp", "job-7-n0-ab12", {"region": "us-central1", "zone": "us-central1-a"})
    make_provider(emulator).terminate(recorded)
    assert (PROJECT, created.data["zone"], created.data["name"]) not in emulator.instances


def test_a_job_on_gcp_boots_its_vm_from_the_controller_and_steps(emulator, tmp_path):
    """The emulator plays Compute Engine's API and tests/vmsandbox.py its machines: the instance's startup-script
    boots in a sandbox (tfsn's wheel and the code from the controller), the job steps and ends, and the
    controller deletes the instance."""
    from tests.vmsandbox import GcePlayer, boot_a_job_to_its_end
    boot_a_job_to_its_end(tmp_path, "gcp", make_provider(emulator), lambda folder, image: GcePlayer(
        emulator, folder, image), {"accelerators": "A100:1", "regions": ["us-central1"]})


def test_an_instance_boots_its_startup_script_and_its_power_off_stops_it(gcp, emulator, tmp_path):
    """With no controller to reach, the boot fails and powers off: the instance reads TERMINATED (stopped)."""
    from tests.vmsandbox import GcePlayer, assert_a_failed_boot_powers_off, vm_image
    player = GcePlayer(emulator, tmp_path / "vms", vm_image(tmp_path / "image"))
    assert_a_failed_boot_powers_off(player, gcp, request())
    assert [body["status"] for body in emulator.instances.values()] == ["TERMINATED"]
