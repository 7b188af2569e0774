"""A process tree on this machine that plays a cloud VM booting its user-data (providers/bootstrap.py).

What a VM gives its boot script, a sandbox gives it too: a Python like a Deep Learning image's (its own venv,
seeing `vm_image`: pip, torch and tfsn's other dependencies, and no tfsn), its own folder as HOME,
working directory and node root (TFSN_NODE_ROOT), and an environment built from nothing (no PYTHONPATH: the
repository checkout is not on its path). Only the machine-level commands are shims (`shutdown`, `poweroff`,
`halt`, `reboot`): each records that it was called, in `shutdown.calls`, and exits 0. Everything else is
real: bash, curl, sha256sum, tar, pip.

A test (or a harness that plays a cloud: when an emulated cloud creates an instance, it starts a
SandboxVM with that instance's user-data, as `Ec2Player` does for moto; killing `vm.process`'s process
group is the VM dying) uses:

    image = vm_image(tmp_path / "image")      # once
    vm = SandboxVM(tmp_path / "vm-1", image)
    vm.start(user_data)          # or vm.run(user_data, timeout=...) to wait for it
    ...
    vm.kill()                    # the VM's whole process tree, at once
"""
from __future__ import annotations

import base64
import contextlib
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


class Ec2Player:
    """Plays EC2's machines for moto, which keeps instances as records only: every instance it starts boots its
    real user-data in a SandboxVM, and a VM that powers off terminates its instance (tfsn asks for
    InstanceInitiatedShutdownBehavior terminate). `kill(instance_id)` is a VM dying under its job.

    Drive it with `poll()` from the test's own loop, or `start()` for a background thread."""

    def __init__(self, ec2, folder: Path, image: Path, env: dict[str, str] | None = None) -> None:
        self.ec2, self.folder, self.image, self.env = ec2, folder, image, env or {}
        self.vms: dict[str, SandboxVM] = {}
        self._ended: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        """Boot the instances moto started since the last poll; terminate those whose VM powered off; kill the
        VMs of instances terminated through the API (a controller's teardown)."""
        pages = self.ec2.get_paginator("describe_instances").paginate()
        for instance in (i for page in pages for r in page["Reservations"] for i in r["Instances"]):
            found, state = instance["InstanceId"], instance["State"]["Name"]
            if state in ("pending", "running") and found not in self.vms:
                data = self.ec2.describe_instance_attribute(InstanceId=found, Attribute="userData")
                script = base64.b64decode(data["UserData"].get("Value", "")).decode()
                self.vms[found] = SandboxVM(self.folder / found, self.image, self.env)
                self.vms[found].start(script)
            elif state in ("shutting-down", "terminated", "stopping", "stopped") and found in self.vms:
                self._ended.add(found)
                self.vms[found].kill()
        for found, vm in self.vms.items():
            if found not in self._ended and vm.shutdown_calls:
                self._ended.add(found)
                self.ec2.terminate_instances(InstanceIds=[found])

    def start(self, period_s: float = 0.5) -> None:
        def loop() -> None:
            while not self._stop.wait(period_s):
                self.poll()
        self._thread = threading.Thread(target=loop, name="ec2-player", daemon=True)
        self._thread.start()

    def kill(self, instance_id: str) -> None:
        """The VM dies: its process tree at once (what EC2 then shows is the test's to say)."""
        self.vms[instance_id].kill()

    def reclaim(self, instance_id: str) -> None:
        """What a spot reclaim looks like: the VM dies at once, and EC2 shows its instance terminated."""
        self._ended.add(instance_id)
        self.vms[instance_id].kill()
        self.ec2.terminate_instances(InstanceIds=[instance_id])

    def stop(self) -> None:
        """Stop playing and kill every VM still running."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for vm in self.vms.values():
            vm.kill()


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
def controller_for_vms(home: Path, providers: dict[str, Any]) -> Iterator[Controller]:
    """A controller running its loop on a thread, with its API where sandbox VMs reach it as cloud nodes reach
    one: TLS with its own CA, at this machine's address beyond loopback (the test is skipped where there is
    none)."""
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
    try:
        yield controller
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def wait_for(condition, timeout: float, what: str) -> None:
    """Poll `condition()` until it holds; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.5)
