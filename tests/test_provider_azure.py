"""The Azure driver through the real azure-mgmt-compute/-network clients, over https, against the local emulator."""
from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("azure.mgmt.compute")
pytest.importorskip("azure.mgmt.network")

from azure.core.credentials import AccessToken  # noqa: E402

from providers.azure import SSH_KEY_ENV, AzureProvider, fetch_offers  # noqa: E402
from providers.base import (AuthError, CapacityError, InvalidRequestError, NodeHandle, NodeRequest,  # noqa: E402
                            NodeStatus, NotFoundError, Offer, QuotaError)
from tests.emulators.azure import AzureEmulator, arm_error  # noqa: E402

SUBSCRIPTION = "00000000-0000-4000-8000-0000000000aa"
VMS = r"/Microsoft.Compute/virtualMachines/"


class StaticToken:
    """A TokenCredential with a fixed token: what azure-core asks of any credential."""

    def get_token(self, *scopes, **kwargs) -> AccessToken:
        return AccessToken("test-token", int(time.time()) + 3600)


@pytest.fixture(scope="module")
def public_key() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    return ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


@pytest.fixture
def emulator():
    with AzureEmulator() as server:
        yield server


def make_provider(emulator: AzureEmulator, **options) -> AzureProvider:
    settings = {"poll_interval_s": 0.01, "operation_timeout_s": 5.0, "rpc_timeout_s": 5.0, **options}
    return AzureProvider(SUBSCRIPTION, credential=StaticToken(), base_url=emulator.url,
                         connection_verify=emulator.ca_path, **settings)


@pytest.fixture
def azure(emulator, public_key, monkeypatch):
    monkeypatch.setenv(SSH_KEY_ENV, public_key)  # a user's key: saves making a throwaway RSA key per test
    return make_provider(emulator)


def offer(zone=None, size="Standard_NC24ads_A100_v4") -> Offer:
    return Offer(provider="azure", region="eastus", zone=zone, instance_type=size, accelerator="A100-80GB",
                 accelerator_count=1, accelerator_memory_gib=80, vcpus=24, memory_gib=220, price=3.67, spot_price=0.95)


def request(node_id="job-7-n0-ab12", spot=False, zone=None) -> NodeRequest:
    return NodeRequest(job_id="7", node_id=node_id, command=["python3", "-m", "orchestrator.agent"],
                       env={"TFSN_NODE_ID": node_id}, workdir="/opt/tfsn", offer=offer(zone), spot=spot)


def test_provision_creates_a_nic_and_a_tagged_vm_that_runs_the_startup_script(azure, emulator):
    handle = azure.provision(request())
    vm = emulator.vms["tfsn-job-7-n0-ab12"]
    props = vm["properties"]
    assert props["hardwareProfile"]["vmSize"] == "Standard_NC24ads_A100_v4"
    assert vm["tags"] == {"tfsn-job": "7", "tfsn-node": "job-7-n0-ab12"} and "zones" not in vm
    assert props["storageProfile"]["osDisk"]["deleteOption"] == "Delete"
    (nic_ref,) = props["networkProfile"]["networkInterfaces"]
    assert nic_ref["properties"]["deleteOption"] == "Delete"
    nic = emulator.nics["tfsn-job-7-n0-ab12-nic"]
    assert nic_ref["id"] == nic["id"]
    assert nic["properties"]["ipConfigurations"][0]["properties"]["subnet"]["id"].endswith(
        "/virtualNetworks/tfsn-eastus/subnets/nodes")
    script = emulator.custom_data["tfsn-job-7-n0-ab12"]
    assert script.startswith("#!/bin/bash") and "\ntrap tfsn_finish EXIT\n" in script   # powers off on any exit
    assert script.rstrip().endswith("\npython3 -m orchestrator.agent")
    assert "priority" not in props
    ssh = props["osProfile"]["linuxConfiguration"]["ssh"]["publicKeys"]
    assert [k["keyData"] for k in ssh] == [os.environ[SSH_KEY_ENV]]
    assert azure.status(handle) is NodeStatus.RUNNING


def test_without_a_users_key_the_vm_gets_a_throwaway_one(emulator, monkeypatch):
    monkeypatch.delenv(SSH_KEY_ENV, raising=False)
    make_provider(emulator).provision(request())
    (key,) = emulator.vms["tfsn-job-7-n0-ab12"]["properties"]["osProfile"]["linuxConfiguration"]["ssh"]["publicKeys"]
    assert key["keyData"].startswith("ssh-rsa ") and len(key["keyData"]) > 500


def test_spot_vm_is_deleted_on_eviction_and_then_reads_terminated(azure, emulator):
    handle = azure.provision(request(spot=True, zone="2"))
    vm = emulator.vms["tfsn-job-7-n0-ab12"]
    assert vm["zones"] == ["2"]
    assert (vm["properties"]["priority"], vm["properties"]["evictionPolicy"]) == ("Spot", "Delete")
    assert vm["properties"]["billingProfile"] == {"maxPrice": -1}
    emulator.evict("tfsn-job-7-n0-ab12")
    assert azure.status(handle) is NodeStatus.TERMINATED
    assert emulator.nics == {}  # went with the VM


def test_provision_polls_long_running_operations_until_they_succeed(azure, emulator):
    emulator.pending_polls = 2
    handle = azure.provision(request())
    assert emulator.count("GET", r"/Microsoft.Compute/locations/eastus/operations/") == 3
    assert emulator.vms["tfsn-job-7-n0-ab12"]["properties"]["provisioningState"] == "Succeeded"
    assert azure.status(handle) is NodeStatus.RUNNING


@pytest.mark.parametrize("state, expected", [("Creating", NodeStatus.PENDING), ("Succeeded", NodeStatus.RUNNING),
                                             ("Failed", NodeStatus.TERMINATED), ("Deleting", NodeStatus.TERMINATED)])
def test_status_follows_provisioning_and_power_state(azure, emulator, state, expected):
    handle = azure.provision(request())
    emulator.vms["tfsn-job-7-n0-ab12"]["properties"]["provisioningState"] = state
    assert azure.status(handle) is expected


IDENTITY = (f"/subscriptions/{SUBSCRIPTION}/resourceGroups/tfsn-ids/providers/Microsoft.ManagedIdentity/"
            "userAssignedIdentities/tfsn-node")


def with_identity(req: NodeRequest) -> NodeRequest:
    return NodeRequest(**{**req.__dict__, "identity": IDENTITY})


def test_the_vm_runs_as_the_jobs_user_assigned_identity(azure, emulator):
    emulator.add_identity(IDENTITY)
    handle = azure.provision(with_identity(request()))
    # As ARM reports it, read back through the SDK.
    vm = azure._client("compute").virtual_machines.get(handle.data["resource_group"], handle.data["vm"])
    assert vm.identity.type == "UserAssigned"
    assert list(vm.identity.user_assigned_identities) == [IDENTITY]
    assert vm.identity.user_assigned_identities[IDENTITY].client_id


def test_no_identity_asks_for_none(azure, emulator):
    handle = azure.provision(request())
    assert "identity" not in emulator.vms[handle.data["vm"]]


@pytest.mark.parametrize("exists,error,fix", [
    (False, InvalidRequestError, "az identity create"),
    (True, AuthError, "Managed Identity Operator"),
])
def test_a_refused_identity_blocks_the_cloud_with_the_fix_and_frees_the_nic(azure, emulator, exists, error, fix):
    """ARM's answers for an identity that does not exist and for one the caller may not assign: the same in every
    region, so the whole cloud is blocked; the NIC made for the VM is deleted."""
    if exists:
        emulator.add_identity(IDENTITY, assignable=False)
    with pytest.raises(error) as caught:
        azure.provision(with_identity(request()))
    text = str(caught.value)
    assert caught.value.scope == "provider" and not caught.value.retryable and "\n" not in text
    assert "tfsn-node" in text and fix in text.split("To fix:")[1] and "resources.remote_identity.azure" in text
    assert not emulator.vms and not emulator.nics


def test_provision_twice_makes_one_vm_and_a_restarted_controller_finds_it(azure, emulator):
    first = azure.provision(request())
    assert azure.provision(request()) == first
    assert emulator.count("PUT", VMS) == 1
    azure.provision(request(node_id="job-7-n1-cd34"))
    assert emulator.count("PUT", r"/virtualNetworks/") == 1  # one vnet per region
    restored = NodeHandle(**json.loads(json.dumps(first.__dict__)))
    fresh = make_provider(emulator)
    assert fresh.status(restored) is NodeStatus.RUNNING
    fresh.terminate(restored)
    assert set(emulator.vms) == {"tfsn-job-7-n1-cd34"} and set(emulator.nics) == {"tfsn-job-7-n1-cd34-nic"}
    assert fresh.status(restored) is NodeStatus.TERMINATED
    fresh.terminate(restored)  # already gone: not an error


@pytest.mark.parametrize("code, zone, scope", [
    ("AllocationFailed", None, "region"),
    ("AllocationFailed", "1", "zone"),
    ("ZonalAllocationFailed", "1", "zone"),
    ("OverconstrainedAllocationRequest", None, "region"),
])
def test_allocation_failure_is_a_capacity_error_and_leaves_nothing_behind(azure, emulator, code, zone, scope):
    emulator.fail_next_operation(code, "Allocation failed. We do not have sufficient capacity for the requested "
                                       "VM size in this region.")
    with pytest.raises(CapacityError) as err:
        azure.provision(request(zone=zone))
    assert err.value.scope == scope and code in str(err.value) and "To fix" in str(err.value)
    assert emulator.vms == {} and emulator.nics == {}


@pytest.mark.parametrize("status, code, message, error, scope", [
    (409, "SkuNotAvailable", "The requested VM size Standard_NC24ads_A100_v4 is currently not available in "
                             "location 'eastus'.", CapacityError, "region"),
    (409, "OperationNotAllowed", "Operation could not be completed as it results in exceeding approved "
                                 "standardNCADSA100v4Family Cores quota.", QuotaError, "region"),
    (403, "AuthorizationFailed", "The client does not have authorization to perform action "
                                 "'Microsoft.Compute/virtualMachines/write'.", AuthError, "provider"),
    (401, "InvalidAuthenticationToken", "The access token is invalid.", AuthError, "provider"),
    (400, "InvalidParameter", "The value of parameter imageReference.sku is invalid.", InvalidRequestError, "offer"),
])
def test_refused_vm_requests_map_to_typed_errors_and_free_the_nic(azure, emulator, status, code, message, error,
                                                                    scope):
    emulator.fail_next("PUT", VMS, status, arm_error(code, message))
    with pytest.raises(error) as err:
        azure.provision(request())
    assert err.value.scope == scope and code in str(err.value)
    assert emulator.vms == {} and emulator.nics == {}


def test_a_missing_resource_group_says_how_to_create_it(azure, emulator):
    handle = azure.provision(request(node_id="made-before"))
    emulator.resource_groups = set()
    with pytest.raises(NotFoundError) as err:
        azure.provision(request())
    assert err.value.scope == "provider" and "az group create" in str(err.value)
    azure.terminate(handle)  # the group and the node in it are gone: not an error


def test_throttled_requests_are_retried(azure, emulator):
    emulator.fail_next("PUT", VMS, 429, arm_error("TooManyRequests", "Throttled"), headers={"Retry-After": "0"})
    handle = azure.provision(request())
    assert emulator.count("PUT", VMS) == 2
    assert azure.status(handle) is NodeStatus.RUNNING


def test_an_operation_past_its_deadline_deletes_the_vm_and_fails_over(emulator):
    azure = make_provider(emulator, operation_timeout_s=0.3)
    emulator.vm_create_polls = 10**6
    with pytest.raises(CapacityError) as err:
        azure.provision(request())
    assert "not done within" in str(err.value) and err.value.scope == "region"
    assert emulator.count("DELETE", VMS + "tfsn-job-7-n0-ab12$") == 1


def test_fetch_offers_joins_resource_skus_with_retail_prices(azure, emulator):
    emulator.fail_next("GET", r"/api/retail/prices", 429, {"message": "slow down"}, headers={"Retry-After": "0"})
    offers = fetch_offers(provider=azure, prices_url=emulator.url + "/api/retail/prices")
    found = {(o.instance_type, o.region): o for o in offers}
    # Standard_NC24ads_A100_v4 is restricted in westeurope for this subscription: left out there.
    assert set(found) == {("Standard_NC24ads_A100_v4", "eastus"), ("Standard_ND96isr_H100_v5", "eastus"),
                          ("Standard_NC4as_T4_v3", "eastus"), ("Standard_NC4as_T4_v3", "westeurope"),
                          ("Standard_D4s_v5", "eastus")}
    h100 = found[("Standard_ND96isr_H100_v5", "eastus")]
    assert (h100.accelerator, h100.accelerator_count, h100.vcpus, h100.memory_gib) == ("H100", 8, 96.0, 1900.0)
    assert (h100.price, h100.spot_price) == (98.32, 29.496)  # Linux, not Windows, reservation or low priority
    cpu = found[("Standard_D4s_v5", "eastus")]
    assert (cpu.accelerator, cpu.accelerator_count, cpu.price) == (None, 0, 0.192)
    assert emulator.count("GET", r"/api/retail/prices") > 4  # several pages, after one throttled answer
    assert [o.instance_type for o in fetch_offers(["westeurope"], provider=azure,
                                                  prices_url=emulator.url + "/api/retail/prices")] == \
        ["Standard_NC4as_T4_v3"]


def test_provision_needs_an_azure_offer(azure):
    with pytest.raises(InvalidRequestError, match="needs a planned azure offer"):
        azure.provision(NodeRequest(job_id="7", node_id="n", command=["true"], env={}, workdir="/"))


def test_a_vm_created_before_the_controller_recorded_it_is_found_by_its_name(azure, emulator):
    azure.provision(request())                       # the answer never reached the store
    recorded = NodeHandle("azure", "job-7-n0-ab12", {"region": offer().region})   # all the intent says
    make_provider(emulator).terminate(recorded)
    assert emulator.vms == {} and emulator.nics == {}


def test_a_job_on_azure_boots_its_vm_from_the_controller_and_steps(emulator, public_key, monkeypatch, tmp_path):
    """The emulator plays ARM and tests/vmsandbox.py the machines: the VM's custom data boots in a sandbox (tfsn's
    wheel and the code from the controller), the job steps and ends, and the controller deletes the VM."""
    from tests.vmsandbox import AzureVmPlayer, boot_a_job_to_its_end
    monkeypatch.setenv(SSH_KEY_ENV, public_key)
    boot_a_job_to_its_end(tmp_path, "azure", make_provider(emulator), lambda folder, image: AzureVmPlayer(
        emulator, folder, image), {"accelerators": "T4:1", "regions": ["eastus"]})


def test_a_vm_boots_its_custom_data_and_its_power_off_stops_it(azure, emulator, tmp_path):
    """With no controller to reach, the boot fails and powers off: the VM reads PowerState/stopped."""
    from tests.vmsandbox import AzureVmPlayer, assert_a_failed_boot_powers_off, vm_image
    player = AzureVmPlayer(emulator, tmp_path / "vms", vm_image(tmp_path / "image"))
    assert_a_failed_boot_powers_off(player, azure, request())
    assert emulator.stopped == {"tfsn-job-7-n0-ab12"}
