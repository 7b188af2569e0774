"""A process tree on this machine that plays a cloud VM booting its user-data (providers/bootstrap.py).

What a VM gives its boot script, a sandbox gives it too: a Python like a Deep Learning image's (its own venv,
seeing `vm_image`: pip, torch and tfsn's other dependencies, and no tfsn), its own folder as HOME,
working directory and node root (TFSN_NODE_ROOT), and an environment built from nothing (no PYTHONPATH: the
repository checkout is not on its path). Only the machine-level commands are shims (`shutdown`, `poweroff`,
`halt`, `reboot`): each records that it was called, in `shutdown.calls`, and exits 0. Everything else is
real: bash, curl, sha256sum, tar, pip.

A test (or a harness that plays a cloud: when an emulated cloud creates an instance, it starts a
SandboxVM with that instance's user-data, as the VmPlayers below do for moto's EC2 and the GCP and Azure
emulators; killing the VM's process tree is the VM dying) uses:

    image = vm_image(tmp_path / "image")      # once
    vm = SandboxVM(tmp_path / "vm-1", image)
    vm.start(user_data)          # or vm.run(user_data, timeout=...) to wait for it
    ...
    vm.kill()                    # the VM's whole process tree, at once
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from orchestrator.control.api import ApiServer
from orchestrator.control.controller import Controller
from orchestrator.control.store import Store
from providers.base import BootFiles, NodeRequest, NodeStatus
from providers.processes import pids_with_env

MACHINE_COMMANDS = ("shutdown", "poweroff", "halt", "reboot")
VM_TAG = "TFSN_SANDBOX_VM"   # in the environment of every process of a sandbox VM: its folder
# Network calls of the boot script: fewer and quicker retries than on a cloud, where a controller may restart.
QUICK_RETRIES = {"TFSN_BOOT_RETRIES": "2", "TFSN_BOOT_RETRY_DELAY_S": "1"}


def vm_image(folder: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """What every sandbox VM's Python sees of the packages of the Python running the tests: all but tfsn (so
    that a boot that installs nothing cannot import it) and the distributions named in `leave_out` (what the
    boot must install), as links in `folder` (made once, read-only)."""
    shared = Path(sysconfig.get_paths()["purelib"])
    folder.mkdir(parents=True, exist_ok=True)
    left_out = {name.lower().replace("-", "_") for name in leave_out}
    for entry in shared.iterdir():
        distribution = entry.name.split("-")[0].split(".")[0].lower()   # s3fs, s3fs-2026.7.0.dist-info
        if "tfsn" not in entry.name.lower() and entry.suffix != ".pth" and distribution not in left_out:
            (folder / entry.name).symlink_to(entry)
    return folder


def _vm_python(folder: Path, image: Path) -> Path:
    """The VM's own Python (a venv, like a fresh disk's): it sees `image`, and pip installs into its own
    site-packages. Its bin folder, to put on the VM's PATH as `python3`."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    own = Path(subprocess.run([str(folder / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                               "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    (own / "image-packages.pth").write_text(f"{image}\n")
    return folder / "bin"


class SandboxVM:
    """One VM: its folder, its process tree, and what its machine-level commands recorded."""

    def __init__(self, folder: Path, image: Path, env: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.root = folder / "node"           # TFSN_NODE_ROOT: boot.log, downloads, the workdir
        self.shims = folder / "machine-bin"
        self.calls = folder / "shutdown.calls"
        self.process: subprocess.Popen | None = None
        self.shims.mkdir(parents=True, exist_ok=True)
        image_bin = _vm_python(folder / "python", image)
        for name in MACHINE_COMMANDS:
            shim = self.shims / name
            shim.write_text(f'#!/bin/sh\necho "{name} $*" >> {self.calls}\n')
            shim.chmod(0o755)
        self.env = {"PATH": f"{self.shims}:{image_bin}:/usr/local/bin:/usr/bin:/bin", "HOME": str(folder),
                    "LANG": "C.UTF-8", "TFSN_NODE_ROOT": str(self.root), "PIP_NO_INDEX": "1",
                    "PIP_DISABLE_PIP_VERSION_CHECK": "1", VM_TAG: str(folder), **QUICK_RETRIES, **(env or {})}

    def start(self, user_data: str) -> subprocess.Popen:
        """Boot: run the user-data with bash, in its own session (the VM's process tree)."""
        script = self.folder / "user-data"
        script.write_text(user_data)
        found = subprocess.run(["bash", "-c", "command -v shutdown"], env=self.env, capture_output=True, text=True)
        assert found.stdout.strip() == str(self.shims / "shutdown"), "the VM's shutdown must be the shim"
        self.process = subprocess.Popen(["bash", str(script)], cwd=self.folder, env=self.env, start_new_session=True,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return self.process

    def run(self, user_data: str, timeout: float) -> int:
        """Boot and wait for the script to end; its exit code."""
        self.start(user_data)
        try:
            self.process.communicate(timeout=timeout)
        finally:
            self.kill()
        return self.process.returncode

    def kill(self) -> None:
        """The VM dies: every process of it at once, wherever it was reparented to (torchrun starts its workers
        in sessions of their own), found by the VM's tag in their environment."""
        if self.process is None:
            return
        for _ in range(50):
            pids = pids_with_env(**{VM_TAG: str(self.folder)})
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        self.process.wait()

    @property
    def shutdown_calls(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []

    @property
    def boot_log(self) -> str:
        log = self.root / "boot.log"
        return log.read_text(errors="replace") if log.exists() else ""


class VmPlayer:
    """Plays the machines of an emulated cloud, which keeps instances as records only: every instance it starts
    boots its real boot script in a SandboxVM; a VM that powers off shows in the cloud as a guest shutdown does
    there; an instance the cloud no longer runs (deleted, terminated, stopped) has its VM killed.
    `kill(instance)` is a VM dying under its job, `reclaim(instance)` a spot reclaim (the VM dies at once and
    the cloud shows its instance gone). A subclass says how its cloud lists instances and their boot scripts,
    and what a power-off and a reclaim look like there.

    Drive it with `poll()` from the test's own loop, or `start()` for a background thread."""

    def __init__(self, folder: Path, image: Path, env: dict[str, str] | None = None) -> None:
        self.folder, self.image, self.env = folder, image, env or {}
        self.vms: dict[str, SandboxVM] = {}
        self._ended: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def running(self) -> dict[str, bool]:
        """The cloud's instances: id -> whether the cloud runs it (or is starting it)."""
        raise NotImplementedError

    def boot_script(self, instance: str) -> str:
        raise NotImplementedError

    def machine_env(self, instance: str) -> dict[str, str]:
        """The environment the instance's machine gives its boot script (what its image and metadata hold)."""
        return self.env

    def powered_off(self, instance: str) -> None:
        """What the cloud shows once the instance's OS shut down."""
        raise NotImplementedError

    def reclaimed(self, instance: str) -> None:
        """What the cloud shows once it reclaimed a spot instance."""
        raise NotImplementedError

    def poll(self) -> None:
        """Boot the instances started since the last poll; kill the VMs of those the cloud no longer runs (a
        controller's teardown); show the cloud the VMs that powered off."""
        running = self.running()
        for found, alive in running.items():
            if alive and found not in self.vms:
                self.vms[found] = SandboxVM(self.folder / found.replace("/", "-"), self.image, self.machine_env(found))
                self.vms[found].start(self.boot_script(found))
        for found, vm in self.vms.items():
            if found not in self._ended and not running.get(found, False):
                self._ended.add(found)
                vm.kill()
            elif found not in self._ended and vm.shutdown_calls:
                self._ended.add(found)
                self.powered_off(found)

    def start(self, period_s: float = 0.5) -> None:
        def loop() -> None:
            while not self._stop.wait(period_s):
                self.poll()
        self._thread = threading.Thread(target=loop, name=f"{type(self).__name__}", daemon=True)
        self._thread.start()

    def kill(self, instance: str) -> None:
        """The VM dies: its process tree at once (what the cloud then shows is the test's to say)."""
        self.vms[instance].kill()

    def reclaim(self, instance: str) -> None:
        """What a spot reclaim looks like: the VM dies at once, and the cloud shows its instance gone."""
        self._ended.add(instance)
        self.vms[instance].kill()
        self.reclaimed(instance)

    def stop(self) -> None:
        """Stop playing and kill every VM still running."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for vm in self.vms.values():
            vm.kill()


class Ec2Player(VmPlayer):
    """moto's EC2 (a boto3 client `ec2`): the user-data boots; a VM that powers off terminates its instance (tfsn
    asks for InstanceInitiatedShutdownBehavior terminate), and so does a reclaim. An instance that EC2 says carries
    an IAM instance profile also gets `role_env`: its role's credentials, which EC2's instance metadata serves to
    such an instance only (here in the environment, where botocore's chain reads them too)."""

    def __init__(self, ec2, folder: Path, image: Path, env: dict[str, str] | None = None,
                 role_env: dict[str, str] | None = None) -> None:
        super().__init__(folder, image, env)
        self.ec2 = ec2
        self.role_env = role_env or {}

    def machine_env(self, instance: str) -> dict[str, str]:
        [found] = [i for r in self.ec2.describe_instances(InstanceIds=[instance])["Reservations"] for i in r["Instances"]]
        return {**self.env, **(self.role_env if "IamInstanceProfile" in found else {})}

    def running(self) -> dict[str, bool]:
        pages = self.ec2.get_paginator("describe_instances").paginate()
        return {i["InstanceId"]: i["State"]["Name"] in ("pending", "running")
                for page in pages for r in page["Reservations"] for i in r["Instances"]}

    def boot_script(self, instance: str) -> str:
        data = self.ec2.describe_instance_attribute(InstanceId=instance, Attribute="userData")
        return base64.b64decode(data["UserData"].get("Value", "")).decode()

    def powered_off(self, instance: str) -> None:
        self.ec2.terminate_instances(InstanceIds=[instance])

    reclaimed = powered_off


class GcePlayer(VmPlayer):
    """tests/emulators/gcp.py's Compute Engine (instances named "PROJECT/ZONE/NAME"): the startup-script metadata
    boots; a VM that powers off reads TERMINATED (stopped: the controller deletes it); a reclaimed spot VM is
    deleted (tfsn's instanceTerminationAction)."""

    def __init__(self, emulator, folder: Path, image: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(folder, image, env)
        self.emulator = emulator

    def running(self) -> dict[str, bool]:
        return {"/".join(key): body["status"] in ("PROVISIONING", "STAGING", "RUNNING")
                for key, body in list(self.emulator.instances.items())}

    def boot_script(self, instance: str) -> str:
        items = self.emulator.instances[tuple(instance.split("/"))]["metadata"]["items"]
        return next(item["value"] for item in items if item["key"] == "startup-script")

    def powered_off(self, instance: str) -> None:
        self.emulator.set_status(*instance.split("/"), "TERMINATED")

    def reclaimed(self, instance: str) -> None:
        self.emulator.preempt(*instance.split("/"))


class AzureVmPlayer(VmPlayer):
    """tests/emulators/azure.py's ARM (VMs by name): the custom data boots; a VM that powers off reads
    PowerState/stopped (the controller deletes it); a reclaimed spot VM is deleted (tfsn's evictionPolicy)."""

    def __init__(self, emulator, folder: Path, image: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(folder, image, env)
        self.emulator = emulator

    def running(self) -> dict[str, bool]:
        return {name: vm["properties"]["provisioningState"] in ("Creating", "Succeeded")
                and name not in self.emulator.stopped for name, vm in list(self.emulator.vms.items())}

    def boot_script(self, instance: str) -> str:
        return self.emulator.custom_data[instance]

    def powered_off(self, instance: str) -> None:
        self.emulator.stopped.add(instance)

    def reclaimed(self, instance: str) -> None:
        self.emulator.evict(instance)


def this_machines_address() -> str | None:
    """An address of this machine beyond loopback (cloud nodes never reach a controller on 127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))   # sends nothing: the route's source address is what is asked
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@contextlib.contextmanager
def controller_for_vms(home: Path, providers: dict[str, Any], player: VmPlayer | None = None) -> Iterator[Controller]:
    """A controller running its loop on a thread, with its API where sandbox VMs reach it as cloud nodes reach
    one: TLS with its own CA, at this machine's address beyond loopback (the test is skipped where there is
    none); `player` plays its cloud's machines meanwhile (and kills them at the end)."""
    address = this_machines_address()
    if address is None:
        pytest.skip("this machine has no address beyond loopback for the VMs to reach the controller at")
    store = Store(home / "tfsn.db")
    controller = Controller(store, home, providers)
    server = ApiServer(0, store, controller.handlers, host="0.0.0.0", advertise=address, home=home)
    controller.listen(server)
    server.start()
    stop = threading.Event()
    threading.Thread(target=controller.run_forever, args=(stop, 600), daemon=True).start()
    if player is not None:
        player.start()
    try:
        yield controller
    finally:
        if player is not None:
            player.stop()
        stop.set()
        server.shutdown()
        server.server_close()


def run_to_the_end(controller: Controller, spec: Any, timeout: float) -> tuple[Any, str]:
    """Submit `spec` and wait for the job to succeed: the job as it ended, and its log."""
    from orchestrator.control.store import JobState
    store = controller.ctx.store
    job = store.create_job(spec.name, spec.model_dump(mode="json"), "p", "secret")
    wait_for(lambda: store.job(job.id).state.terminal, timeout, "the job's end")
    log = (controller.ctx.home / "jobs" / str(job.id) / "job.log").read_text()
    assert store.job(job.id).state == JobState.SUCCEEDED, log
    return store.job(job.id), log


def wait_for(condition, timeout: float, what: str) -> None:
    """Poll `condition()` until it holds; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.5)


# A user's script that reaches its first steps: tfsn's SDK from the VM's own install, its telemetry to the controller.
FIRST_STEPS = """import tfsn, torch
run = tfsn.init()
for step in run.steps(0):
    run.log(loss=torch.tensor(1.0 / (step + 1)))
print(f"rank {run.rank} stepped with tfsn from {tfsn.__file__}", flush=True)
run.finish()
"""


def boot_a_job_to_its_end(tmp_path: Path, provider: str, driver: Any, make_player, resources: dict) -> VmPlayer:
    """Launch a one-node job on `provider` (its `driver` on an emulated cloud, whose machines `make_player(folder,
    image)` plays) and check that its VM booted from the controller (tfsn and the code), stepped, and that the
    controller deleted the instance once the job ended. The player, for more checks."""
    from orchestrator.spec import JobSpec
    code, home = tmp_path / "code", tmp_path / "home"
    code.mkdir()
    home.mkdir()
    (code / "train.py").write_text(FIRST_STEPS)
    spec = JobSpec.model_validate({"name": "first", "run": "python train.py", "workdir": str(code), "steps": 2,
                                   "nproc_per_node": 1, "resources": {"infra": [provider], **resources},
                                   "checkpoint": {"dir": str(tmp_path / "ckpt"), "local_ok": True}})
    player = make_player(tmp_path / "vms", vm_image(tmp_path / "image"))
    with controller_for_vms(home, {provider: driver}, player) as controller:
        job, log = run_to_the_end(controller, spec, 240)
        assert job.step == 1, "the last step (index 1 of 2) did not reach the controller"
        wait_for(lambda: not player.running(), 30, "the instance's deletion")
        store = controller.ctx.store
    [vm] = player.vms.values()
    assert f"[rank0]: rank 0 stepped with tfsn from {vm.folder / 'python'}/" in log, log
    assert [n.boot_failure for n in store.nodes(job.id)] == [""]
    return player


def assert_a_failed_boot_powers_off(player: VmPlayer, driver: Any, request: NodeRequest) -> None:
    """Provision `request`'s node with no controller to reach: its boot fails, the VM powers off, and the
    cloud's driver then reads the node as terminated."""
    with socket.socket() as closed:   # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{closed.getsockname()[1]}"
    request = dataclasses.replace(
        request, workdir="workdir",   # under the node's root: the sandbox's own folder
        boot=BootFiles(wheel="tfsn-0.1.0-py3-none-any.whl", wheel_sha256="a" * 64, code_sha256="b" * 64),
        env={"TFSN_NODE_ID": request.node_id, "TFSN_JOB_ID": request.job_id, "TFSN_TOKEN": "t",
             "TFSN_CONTROLLER_URL": nobody})
    handle = driver.provision(request)
    try:
        player.poll()
        [vm] = player.vms.values()
        vm.process.wait(timeout=60)
        player.poll()
    finally:
        player.stop()
    assert vm.shutdown_calls == ["shutdown -h now"] and "boot failed in stage 'install'" in vm.boot_log
    assert driver.status(handle) is NodeStatus.TERMINATED
