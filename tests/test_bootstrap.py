"""A cloud VM's boot, for real: the boot script (providers/bootstrap.py) runs under bash in a sandbox that plays
the VM (tests/vmsandbox.py), against a controller API on loopback (plain and TLS). A failing step or an
unreachable controller still powers off, and the end of the boot log reaches the controller when it can; the
controller's side: what a VM may fetch, boot failures per offer, what provisioning hands a VM driver. A whole
job booting its VMs this way is in tests/test_provider_aws.py (moto plays EC2)."""
from __future__ import annotations

import importlib.metadata
import json
import re
import socket
import subprocess
import time
import tomllib
import urllib.error
import urllib.request

import pytest
from packaging.requirements import Requirement

from orchestrator.control.api import ApiServer
from orchestrator.control.artifacts import repack_installed
from orchestrator.control.boot import (BOOT_FAILURES_PER_OFFER, NODE_WORKDIR, boot_files, prepare_artifacts,
                                       record_artifacts)
from orchestrator.control.controller import Controller
from orchestrator.control.credentials import agent_token
from orchestrator.control.provisioning import agent_command, agent_env
from orchestrator.control.store import JobState, NodeState, Store
from orchestrator.cli.view import boot_failures, job_summary
from orchestrator.spec import CHECKPOINT_DRIVERS, CHECKPOINT_URL_SCHEMES, JobSpec
from providers.base import NodeHandle, NodeRequest, NodeStatus, Offer
from providers.bootstrap import install_command, startup_script
from tests.conftest import ROOT
from tests.vmsandbox import SandboxVM, vm_image

OFFER = {"provider": "aws", "region": "us-east-1", "zone": "use1-az6", "instance_type": "p4d.24xlarge",
         "accelerator": "A100", "accelerator_count": 8, "accelerator_memory_gib": 40.0, "vcpus": 96.0,
         "memory_gib": 1152.0, "price": 32.77, "spot_price": None, "interconnect": None, "arch": "x86_64"}
BOOT_S = 180   # pip installs a wheel twice (alone, then its dependencies, all present in the image)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return vm_image(tmp_path_factory.mktemp("image"))


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    """A controller's API on loopback, with one job (its code packed and tfsn's wheel built)."""
    home, code = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("code")
    (code / "train.py").write_text("print('training')\n")
    store = Store(home / "tfsn.db")
    controller = Controller(store, home, providers={})
    api = ApiServer(0, store, controller.handlers)
    controller.listen(api)
    # The same controller as cloud nodes reach it: TLS with its own CA (its certificate names 127.0.0.1 too).
    tls_api = ApiServer(0, store, controller.handlers, host="0.0.0.0", advertise="tfsn.example", home=home)
    for server in (api, tls_api):
        server.start()
    spec = JobSpec.model_validate({"name": "boot", "run": "python train.py", "workdir": str(code)})
    job = store.create_job("boot", spec.model_dump(mode="json"), "p", "the-secret")
    files = boot_files(controller.ctx, job, spec)
    controller.tls_api = tls_api
    yield controller, store, store.job(job.id), spec, files
    for server in (api, tls_api):
        server.shutdown()
        server.server_close()


def add_node(store, job, node_id: str) -> None:
    store.add_node(node_id, job.id, 0, "aws", offer=OFFER)
    store.update_node(node_id, state=NodeState.STARTING, handle={"provider": "aws", "node_id": node_id, "data": {}},
                      provisioned_at=time.time())


def user_data(controller, job, files, node_id: str, command: list[str] | None = None, url: str = "",
              tls: bool = False) -> str:
    """The script a VM driver puts in the instance's user-data, for a request built as provisioning builds it
    (`tls`: reaching the controller over TLS, trusting its CA only)."""
    if tls:
        url, trust = f"https://127.0.0.1:{controller.tls_api.server_address[1]}", controller.tls_api.trust
    else:
        url, trust = url or controller.url, controller.ctx.trust
    env = agent_env(url, job, node_id, local=False, trust=trust)
    return startup_script(NodeRequest(job_id=str(job.id), node_id=node_id, command=command or agent_command(False),
                                      env=env, workdir=NODE_WORKDIR, boot=files))


def test_a_tampered_wheel_fails_the_install_the_tail_reaches_the_controller_and_the_vm_powers_off(cloud, image,
                                                                                                 tmp_path):
    """Over TLS, as a cloud VM reaches the controller: the download and the report trust the controller's CA."""
    controller, store, job, spec, files = cloud
    add_node(store, job, "bad-0")
    wheel = controller.ctx.artifacts.path(files.wheel_sha256)
    original = wheel.read_bytes()
    wheel.write_bytes(original + b"tampered")
    try:
        vm = SandboxVM(tmp_path / "vm", image)
        assert vm.run(user_data(controller, job, files, "bad-0", tls=True), timeout=BOOT_S) != 0
    finally:
        wheel.write_bytes(original)
    assert vm.shutdown_calls == ["shutdown -h now"]
    node = store.node("bad-0")
    assert f"not {files.wheel_sha256}" in node.boot_failure and node.failure.startswith("boot failed in stage install")
    assert not (vm.root / NODE_WORKDIR / "train.py").exists()   # nothing after the failed step ran
    shown = "\n".join(boot_failures(store, store.job(job.id)))
    assert "node bad-0 failed to boot" in shown and "sha256" in shown
    assert [n["boot_log"] for n in job_summary(store, store.job(job.id))["nodes"] if n["id"] == "bad-0"] == [
        node.boot_failure]
    controller.nodes.check(store.job(job.id), spec)   # the loop fails the node
    assert store.node("bad-0").state == NodeState.FAILED


def test_an_unreachable_controller_still_ends_in_a_power_off(cloud, image, tmp_path):
    controller, store, job, _, files = cloud
    with socket.socket() as closed:   # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    vm = SandboxVM(tmp_path / "vm", image)
    started = time.monotonic()
    assert vm.run(user_data(controller, job, files, "lost-0", url=url), timeout=BOOT_S) != 0
    assert time.monotonic() - started < 60   # bounded retries, then the power-off
    assert vm.shutdown_calls == ["shutdown -h now"]
    assert "boot failed in stage 'install'" in vm.boot_log and "the controller could not be told" in vm.boot_log


def checkpointing_job(controller, store, spec, name: str, url: str):
    """A job of the module's code whose checkpoint.dir is `url`, and its boot files."""
    spec = JobSpec.model_validate({**spec.model_dump(mode="json"), "name": name, "checkpoint": {"dir": url}})
    job = store.create_job(name, spec.model_dump(mode="json"), "p", f"{name}-secret")
    return job, boot_files(controller.ctx, job, spec)


def extra_pin(extra: str, distribution: str) -> Requirement:
    """pyproject's requirement of `distribution` in tfsn[`extra`]."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return next(r for r in map(Requirement, extras[extra]) if r.name == distribution)


def test_a_job_checkpointing_to_s3_gets_s3fs_installed_with_tfsn(cloud, tmp_path):
    """The image lacks s3fs; the boot installs it as tfsn[aws] requires it, from what the VM's pip can reach."""
    controller, store, _, spec, _ = cloud
    job, files = checkpointing_job(controller, store, spec, "s3", "s3://tfsn-ckpt/run")
    assert (files.extra, files.extra_module) == ("aws", "s3fs")
    add_node(store, job, "s3-0")
    wheels = tmp_path / "wheels"   # the VM's package index: a wheel of the s3fs installed here
    wheels.mkdir()
    repack_installed(wheels, "s3fs")
    vm = SandboxVM(tmp_path / "vm", vm_image(tmp_path / "image", leave_out=("s3fs",)), {"PIP_FIND_LINKS": str(wheels)})
    probe = ["python3", "-c", "import importlib.metadata as m, s3fs; print('driver', m.version('s3fs'), s3fs.__file__)"]
    assert vm.run(user_data(controller, job, files, "s3-0", command=probe), timeout=BOOT_S) == 0, vm.boot_log
    version = importlib.metadata.version("s3fs")
    assert f"driver {version} {vm.folder / 'python'}/" in vm.boot_log   # installed on the VM, not the image's
    assert version in extra_pin("aws", "s3fs").specifier
    assert vm.shutdown_calls == ["shutdown -h now"] and store.node("s3-0").boot_failure == ""


def test_a_checkpoint_driver_the_vm_cannot_install_fails_the_boot_saying_so(cloud, tmp_path):
    controller, store, _, spec, _ = cloud
    job, files = checkpointing_job(controller, store, spec, "nos3", "s3://tfsn-ckpt/run")
    add_node(store, job, "nos3-0")
    vm = SandboxVM(tmp_path / "vm", vm_image(tmp_path / "image", leave_out=("s3fs",)))   # and no index
    assert vm.run(user_data(controller, job, files, "nos3-0"), timeout=BOOT_S) != 0
    assert vm.shutdown_calls == ["shutdown -h now"]
    node = store.node("nos3-0")
    assert node.failure.startswith("boot failed in stage install (exit code 1): [tfsn] cannot install tfsn[aws]'s "
                                   "dependencies (s3fs is the driver of the job's checkpoint.dir)"), node.failure
    asked = re.search(r"requirement (s3fs[^ ;]*)", node.boot_failure)   # pip's own line, in the tail shown
    assert asked and Requirement(asked.group(1)).specifier == extra_pin("aws", "s3fs").specifier, node.boot_failure
    assert not (vm.root / NODE_WORKDIR / "train.py").exists()


def test_each_checkpoint_scheme_makes_nodes_install_the_extra_that_pins_its_driver(cloud):
    controller, store, _, spec, _ = cloud
    for scheme, extra in CHECKPOINT_URL_SCHEMES.items():
        job, files = checkpointing_job(controller, store, spec, f"pin-{scheme}", f"{scheme}://bucket/run")
        assert (files.extra, files.extra_module) == (extra, CHECKPOINT_DRIVERS[scheme])
        assert extra_pin(extra, files.extra_module).specifier, f"tfsn[{extra}] leaves {files.extra_module} unpinned"
        assert f".whl'[{extra}]'" in user_data(controller, job, files, "pin-0")
    _, files = checkpointing_job(controller, store, spec, "pin-path", "/shared/ckpt")
    assert (files.extra, files.extra_module) == ("", "")


def test_boot_failures_on_one_offer_block_it_for_the_job(tmp_path):
    store = Store(tmp_path / "tfsn.db")
    controller = Controller(store, tmp_path, providers={})
    api = ApiServer(0, store, controller.handlers)
    api.start()
    try:
        spec = JobSpec.model_validate({"name": "b", "run": "python train.py", "workdir": str(tmp_path)})
        job = store.create_job("b", spec.model_dump(mode="json"), "p", "s")
        store.transition(job.id, JobState.PROVISIONING)
        for n in range(BOOT_FAILURES_PER_OFFER):
            add_node(store, job, f"b-{n}")
            body = json.dumps({"stage": "install", "returncode": 1, "tail": f"pip: error {n}\n"}).encode()
            urllib.request.urlopen(urllib.request.Request(
                f"{api.url}/v1/jobs/{job.id}/nodes/b-{n}/boot-failure", data=body, method="POST", headers={
                    "Authorization": f"Bearer {agent_token(job.token, f'b-{n}')}"}), timeout=10).read()
            assert store.job(job.id).blocked == []   # one failure is the node's; the offer is blocked after the bound
            controller.nodes.check(store.job(job.id), spec)
        blocked = store.job(job.id).blocked
        assert [(b["offer"]["instance_type"], b["scope"]) for b in blocked] == [("p4d.24xlarge", "offer")]
        assert "pip: error 1" in blocked[0]["error"]
        assert {store.node(f"b-{n}").state for n in range(BOOT_FAILURES_PER_OFFER)} == {NodeState.FAILED}
    finally:
        api.shutdown()
        api.server_close()


def test_only_the_jobs_own_nodes_fetch_its_files(cloud):
    controller, store, job, spec, files = cloud
    add_node(store, job, "fetch-0")
    other = store.create_job("other", spec.model_dump(mode="json"), "p", "other-secret")
    store.add_node("other-0", other.id, 0, "aws", offer=OFFER)

    def get(job_id: int, node: str, token: str, digest: str) -> int | bytes:
        request = urllib.request.Request(f"{controller.url}/v1/jobs/{job_id}/nodes/{node}/artifacts/{digest}",
                                         headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.read()
        except urllib.error.HTTPError as err:
            return err.code

    mine = agent_token(job.token, "fetch-0")
    assert get(job.id, "fetch-0", mine, files.code_sha256) == controller.ctx.artifacts.path(
        files.code_sha256).read_bytes()
    assert get(job.id, "fetch-0", mine, files.wheel_sha256)[:2] == b"PK"   # a wheel is a zip
    assert get(other.id, "other-0", agent_token(other.token, "other-0"), files.code_sha256) == 404  # not its job's
    assert get(job.id, "fetch-0", agent_token(other.token, "other-0"), files.code_sha256) == 401
    assert get(other.id, "other-0", agent_token(job.token, "fetch-0"), files.code_sha256) == 401
    assert get(job.id, "fetch-0", mine, "0" * 64) == 404


def test_the_boot_failure_route_takes_a_capped_body(cloud):
    controller, store, job, _, _ = cloud
    add_node(store, job, "cap-0")
    body = json.dumps({"stage": "install", "returncode": 1, "tail": "x" * 70_000}).encode()
    request = urllib.request.Request(f"{controller.url}/v1/jobs/{job.id}/nodes/cap-0/boot-failure", data=body,
                                     headers={"Authorization": f"Bearer {agent_token(job.token, 'cap-0')}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 413 and store.node("cap-0").boot_failure == ""


class RecordingCloud:
    """A stand-in for a VM driver on the controller's side: it records the requests it is given (the drivers'
    own calls are tested against their emulators), and its nodes never speak."""

    name = "aws"
    runs_boot_script = True
    status_poll_s = 0.0

    def __init__(self) -> None:
        self.requests: list[NodeRequest] = []

    def offers(self) -> list[Offer]:
        return [Offer(**OFFER)]

    def provision(self, request: NodeRequest) -> NodeHandle:
        self.requests.append(request)
        return NodeHandle(self.name, request.node_id, {})

    def status(self, handle: NodeHandle) -> NodeStatus:
        return NodeStatus.RUNNING

    def terminate(self, handle: NodeHandle) -> None:
        pass


def test_provisioning_packs_the_code_once_and_every_vm_of_the_job_gets_the_same_files(cloud, tmp_path):
    controller, *_ = cloud
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print(1)\n")
    store = Store(tmp_path / "tfsn.db")
    vms = RecordingCloud()
    # the same home as the module's controller: its wheel is built already, and found by version and source
    again = Controller(store, controller.ctx.home, {"aws": vms}, url="https://10.0.0.5:7000")
    spec = JobSpec.model_validate({"name": "two", "run": "python train.py", "workdir": str(code), "num_nodes": 2,
                                   "resources": {"infra": ["aws"], "accelerators": "A100:8"}})
    job = store.create_job("two", spec.model_dump(mode="json"), "p", "s")
    for _ in range(3):
        again.reconcile(job.id)
    assert len(vms.requests) == 2, [e.message for e in store.events(job.id)]
    boots = {r.boot for r in vms.requests}
    assert len(boots) == 1 and {r.workdir for r in vms.requests} == {NODE_WORKDIR}
    boot = boots.pop()
    archive = again.ctx.artifacts.path(boot.code_sha256)
    assert store.job(job.id).artifacts == {"code": boot.code_sha256, "wheel": boot.wheel_sha256}
    assert boot.wheel == controller.ctx.artifacts.wheel().name and archive is not None
    packs = [e.message for e in store.events(job.id) if e.message.startswith("packed")]
    assert len(packs) == 1, packs


def test_a_cloud_job_whose_code_is_over_the_cap_fails_with_the_one_line_error(cloud, tmp_path, monkeypatch):
    controller, *_ = cloud
    code = tmp_path / "code"
    code.mkdir()
    (code / "weights.bin").write_bytes(b"0" * 2 * 2**20)
    monkeypatch.setenv("TFSN_CODE_MAX_MB", "1")
    store = Store(tmp_path / "tfsn.db")
    vms = RecordingCloud()
    again = Controller(store, controller.ctx.home, {"aws": vms}, url="https://10.0.0.5:7000")
    spec = JobSpec.model_validate({"name": "big", "run": "python train.py", "workdir": str(code),
                                   "resources": {"infra": ["aws"], "accelerators": "A100:8"}})
    job = store.create_job("big", spec.model_dump(mode="json"), "p", "s")
    for _ in range(2):
        again.reconcile(job.id)
    failed = store.job(job.id)
    assert failed.state == JobState.FAILED and vms.requests == [] and store.nodes(job.id) == []
    assert "2.0 MiB" in failed.error and "cap of 1.0 MiB" in failed.error and "\n" not in failed.error


def test_a_pod_image_without_tfsn_installs_only_the_users_spec_never_the_bare_name(tmp_path):
    """Kubernetes pods and SkyPilot clusters start from an image: its tfsn, else TFSN_INSTALL_SPEC, else a stop."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "pip.calls"
    (bin_dir / "python3").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    alone = subprocess.run(["sh", "-c", install_command()], env=env, capture_output=True, text=True)
    assert alone.returncode == 1 and not calls.exists()
    assert alone.stderr.count("\n") == 1 and "To fix:" in alone.stderr and "TFSN_INSTALL_SPEC" in alone.stderr
    given = subprocess.run(["sh", "-c", install_command()], env={**env, "TFSN_INSTALL_SPEC": "tfsn @ https://x/t.whl"},
                           capture_output=True, text=True)
    assert given.returncode == 0 and calls.read_text().split("\n")[0].endswith("install --quiet "
                                                                               "--disable-pip-version-check "
                                                                               "tfsn @ https://x/t.whl")


def test_with_an_install_spec_no_wheel_is_built_and_an_ended_jobs_archive_goes_when_another_is_packed(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TFSN_INSTALL_SPEC", "tfsn @ https://wheels.example/tfsn-0.1.0-py3-none-any.whl")
    home = tmp_path / "home"
    home.mkdir()
    store = Store(home / "tfsn.db")
    controller = Controller(store, home, providers={})
    digests = []
    for name in ("old", "new"):
        code = tmp_path / name
        code.mkdir()
        (code / "train.py").write_text(f"print({name!r})\n")
        spec = JobSpec.model_validate({"name": name, "run": "python train.py", "workdir": str(code)})
        job = store.create_job(name, spec.model_dump(mode="json"), "p", "s")
        files = boot_files(controller.ctx, job, spec)
        assert (files.wheel, files.wheel_sha256) == ("", "") and store.job(job.id).artifacts == {
            "code": files.code_sha256}
        digests.append(files.code_sha256)
        store.transition(job.id, JobState.FAILED)   # the first one ends before the second is packed
    assert controller.ctx.artifacts.path(digests[0]) is None   # no job needs it any more
    assert controller.ctx.artifacts.path(digests[1]) is not None
    env = agent_env("https://10.0.0.5:7000", store.job(2), "n0", local=False)
    script = startup_script(NodeRequest(job_id="2", node_id="n0", command=agent_command(False), env=env,
                                        workdir=NODE_WORKDIR, boot=files))
    assert '\npython3 -m pip install --quiet --disable-pip-version-check "$TFSN_INSTALL_SPEC"\n' in script
    assert "tfsn_fetch" in script and ".whl" not in script.split("tfsn_stage=install")[1]


def test_an_archive_packed_for_one_job_survives_another_jobs_record_before_its_own(tmp_path, monkeypatch):
    """Two cloud jobs packed in workers at once: the loop records one, and its pruning must not delete the other's
    archive (no active job names it yet), nor an ended job's same archive that a relaunch just packed again (before:
    deleted, so the second record failed and its VMs' code downloads found nothing)."""
    monkeypatch.setenv("TFSN_INSTALL_SPEC", "tfsn @ https://wheels.example/tfsn-0.1.0-py3-none-any.whl")
    home = tmp_path / "home"
    home.mkdir()
    store = Store(home / "tfsn.db")
    ctx = Controller(store, home, providers={}).ctx
    jobs = {}
    for name in ("a", "b", "a-again"):
        code = tmp_path / name.removesuffix("-again")
        code.mkdir(exist_ok=True)
        (code / "train.py").write_text(f"print({name.removesuffix('-again')!r})\n")
        spec = JobSpec.model_validate({"name": name, "run": "python train.py", "workdir": str(code)})
        jobs[name] = (store.create_job(name, spec.model_dump(mode="json"), "p", "s"), spec)
    first, spec = jobs["a"]
    record_artifacts(ctx, first, spec, prepare_artifacts(ctx, first, spec))
    store.transition(first.id, JobState.FAILED)   # a's code, recorded by an ended job only
    packed = {name: prepare_artifacts(ctx, *jobs[name]) for name in ("b", "a-again")}   # workers: both packed
    assert packed["a-again"]["code"] == store.job(first.id).artifacts["code"]
    for name in ("b", "a-again"):   # the loop records them one by one, each pruning
        job, spec = jobs[name]
        record_artifacts(ctx, store.job(job.id), spec, packed[name])
    for name in ("b", "a-again"):
        job, spec = jobs[name]
        files = boot_files(ctx, store.job(job.id), spec)
        assert files.code_sha256 == packed[name]["code"] and ctx.artifacts.path(files.code_sha256) is not None, name
