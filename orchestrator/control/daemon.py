"""The controller as a background process: one per `$TFSN_HOME`, started on demand.

`ensure_controller()` is what the CLI calls: it returns the URL of the running controller, starting
one if none answers. The controller takes its previous port back when restarted, so agents and
workers that kept running while it was down find it again.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from orchestrator.control import tls
from orchestrator.home import atomic_write_text, private_open, tfsn_home
from orchestrator.control.store import Store
from orchestrator.sdk.client import ControllerUntrusted, pinned_context

START_TIMEOUT_S = 30.0


class ControllerStartError(Exception):
    """The controller process did not come up."""


def store_path(home: Path) -> Path:
    return home / "tfsn.db"


def info_path(home: Path) -> Path:
    return home / "controller.json"


def read_info(home: Path) -> dict | None:
    """The running controller's pid and URL, if it answers (over https: trusting its CA only)."""
    try:
        info = json.loads(info_path(home).read_text())
        https = info["url"].startswith("https:")
        context = pinned_context((tls.folder(home) / tls.CA_CERT).read_text()) if https else None
        with urllib.request.urlopen(f"{info['url']}/healthz", timeout=2, context=context) as response:
            if json.loads(response.read()).get("pid") == info["pid"]:  # not another process on that port
                return info
    except (OSError, ValueError, KeyError, ControllerUntrusted):
        pass
    return None


def ensure_controller(home: Path | None = None) -> dict:
    """The running controller's info; starts the controller in the background if none answers."""
    home = home or tfsn_home()
    info = read_info(home)
    if info is not None:
        return info
    try:
        log = private_open(home / "controller.log", "ab")
    except OSError as err:      # a read-only or full disk: the controller could not write its store either
        raise ControllerStartError(f"cannot start the controller: {home / 'controller.log'}: {err.strerror or err}. "
                                   "To fix: make that folder writable (or free space on its disk), or set TFSN_HOME "
                                   "to another folder") from None
    subprocess.Popen([sys.executable, "-m", "orchestrator.control.daemon"], env={**os.environ, "TFSN_HOME": str(home)},
                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        info = read_info(home)
        if info is not None:
            return info
        time.sleep(0.1)
    raise ControllerStartError(f"the controller did not start within {START_TIMEOUT_S:.0f}s. "
                               f"To fix: read {home / 'controller.log'}")


def stop_controller(home: Path | None = None) -> bool:
    """SIGTERM the running controller; jobs keep running and are picked up by the next one."""
    info = read_info(home or tfsn_home())
    if info is None:
        return False
    os.kill(info["pid"], signal.SIGTERM)
    return True


def serve(home: Path) -> int:
    """Run the controller in this process until SIGTERM or idle."""
    lock = private_open(home / "controller.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("another controller already runs for this TFSN_HOME", flush=True)
        return 0
    try:
        previous = int(os.environ.get("TFSN_API_PORT") or json.loads(info_path(home).read_text()).get("port", 0))
    except (OSError, ValueError):
        previous = int(os.environ.get("TFSN_API_PORT") or 0)
    from orchestrator.control.api import ApiServer          # the controller's own process only: the CLI stays light
    from orchestrator.control.controller import Controller
    from providers.local import LocalProvider

    store = Store(store_path(home))
    controller = Controller(store, home, {"local": LocalProvider()})
    # Loopback unless the user opens the API to cloud nodes (they must be able to reach it; every call
    # still needs the job's token, and beyond loopback it is TLS with this home's CA).
    host, advertise = os.environ.get("TFSN_API_HOST", "127.0.0.1"), os.environ.get("TFSN_API_ADVERTISE", "")
    try:
        server = ApiServer(previous, store, controller.handlers, host, advertise, home)
    except OSError:  # the old port is taken by someone else now
        server = ApiServer(0, store, controller.handlers, host, advertise, home)
    controller.listen(server)
    server.start()
    metrics_port = controller.metrics.serve(int(os.environ.get("TFSN_METRICS_PORT", 0)))
    atomic_write_text(info_path(home), json.dumps({
        "pid": os.getpid(), "port": server.server_address[1], "url": server.url, "started_at": time.time(),
        "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics"}))
    print(f"controller {os.getpid()} listening on {server.url}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    idle_exit_s = float(os.environ.get("TFSN_CONTROLLER_IDLE_S", 300))
    while True:
        controller.run_forever(stop, idle_exit_s)
        server.shutdown()
        # A launch may have slipped in while the loop decided to leave: then serve on.
        if stop.is_set() or not store.jobs(active_only=True):
            break
        server.start()
    print("controller exiting", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve(tfsn_home()))
