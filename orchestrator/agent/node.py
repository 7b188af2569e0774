"""The node agent: one per node, it runs setup once and the workers (under torchrun) on command.

It polls the controller (each poll is also its heartbeat) for what the node should be doing,
starts or stops torchrun accordingly, ships output lines to the job log, and reports how each
attempt ended, retrying until the controller has it. A controller that is down only delays
reports: the workers keep training.

Started by a provider as `python -m orchestrator.agent` with TFSN_CONTROLLER_URL, TFSN_TOKEN,
TFSN_JOB_ID and TFSN_NODE_ID in its environment, and for an https controller TFSN_CA_PEM and
TFSN_CA_FINGERPRINT (the only CA it trusts); the workers it starts inherit all of them.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from health.metrics import Metrics
from health.telemetry import DcgmSource, NvmlSource, TelemetryError
from optimizer.cache import PLAN_FOLDER, cache_dir, install_search_entries
from orchestrator.sdk.client import HEARTBEAT_S, ControllerClient, ControllerRejected, ControllerUnavailable
from providers.processes import pids_with_env

IDLE_POLL_S = 0.25       # polled faster while no workers run, so a restart starts without delay
GPU_SAMPLE_S = 5.0       # NVML / DCGM sampling period
TICK_S = 0.2
STOP_GRACE_S = 10.0
ORPHAN_EXIT_S = 3600.0   # give up on an unreachable controller after this long with nothing running
TAIL_LINES = 200
LAST_LINES_S = 3.0       # the agent's last lines are sent for this long as it goes: within a local node's
                         # TERMINATE_GRACE_S (5 s) before SIGKILL
LOG_BATCH_LINES = 2000   # lines per post, characters per line, and JSON bytes per post: within the API's caps
LOG_LINE_CHARS = 16_000
LOG_BATCH_BYTES = 4 << 20
MAX_PRINTED_BYTES = 4 << 30   # the node's own copy of its lines (a local node's log file, a VM's boot log): a flood
                              # stops there, as the job's log does, instead of filling the node's disk
SAMPLES_PER_POST = 1024
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
# A worker is `bash -c RUN`: a command bash did not exec (`python train.py && ...`, a script's) that a signal N
# killed (the OOM killer's SIGKILL) ends bash with code 128+N, where torchrun sees an exec'd one's -N. bash reports
# the kill ("bash: line 1: 4242 Killed   python train.py"; a script's "train.sh: line 3: ..."); a script's own
# sys.exit(137) ends with the same code and no report, and is the application's error.
SHELL_SIGNALED = 128
_SHELL_KILLED = re.compile(r": line \d+: +\d+ +\S")
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ERROR_LINE = re.compile(r"(^|\s)([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit))\b")
_WORKER_LINE = re.compile(r"^\[rank\d+\]:\s*\S")
_RANK_PREFIX = re.compile(r"^((\[rank\d+\]:\s*)+)")
_TWO_PREFIXES = re.compile(r"^(\[rank(\d+)\]: )\[rank\2\]: ?")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')

# The torchrun wrapper runs by its file's path, not as `-m orchestrator.agent.torchrun`: -m searches the working
# directory first, the user's workdir here, where a package of theirs named `orchestrator` would be run instead.
TORCHRUN_WRAPPER = Path(__file__).resolve().with_name("torchrun.py")


def torchrun_command(cmd: dict[str, Any]) -> list[str]:
    """The command that runs an attempt's workers on this node: torchrun (through its wrapper) over the user's
    `run`, as the controller's start command says."""
    return [
        # -u: torchrun copies its workers' lines to its stdout, a pipe here; buffered, they would come only
        # when the attempt ends (tfsn logs --follow, and a VM's boot log, would show nothing of a running job)
        sys.executable, "-u", str(TORCHRUN_WRAPPER),
        "--nnodes", str(cmd["nnodes"]), "--node-rank", str(cmd["node_rank"]),
        "--nproc-per-node", str(cmd["nproc_per_node"]),
        "--master-addr", cmd["master_addr"], "--master-port", str(cmd["master_port"]),
        "--max-restarts", "0", "--monitor-interval", "0.2", "--tee", "3",
        # torchrun expands its ${local_rank} macro with string.Template, which turns "$$" into "$":
        # escaping every "$" hands bash the user's command verbatim.
        "--no-python", "bash", "-c", cmd["run"].replace("$", "$$")]


class LogShipper:
    """Collects output lines and posts them to the controller in batches, off the hot path."""

    def __init__(self, client: ControllerClient, node_id: str, max_buffer: int = 20000) -> None:
        self.client = client
        self.node_id = node_id
        self.path = f"/nodes/{node_id}/logs"
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._pending: collections.deque[str] = collections.deque(maxlen=max_buffer)
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._in_flight = 0   # the pending lines (at its head) that the post in progress sends
        self._lost = 0        # lines a full buffer dropped before they were sent, not yet said in the job's log
        self._printed = 0
        threading.Thread(target=self._loop, name="tfsn-logs", daemon=True).start()

    def add(self, line: str) -> None:
        line = line.rstrip("\n")
        if self._printed < MAX_PRINTED_BYTES:
            self._printed += len(line.encode(errors="replace")) + 1   # bytes on disk: a tqdm bar's '█' is 3
            print(line if self._printed < MAX_PRINTED_BYTES else
                  f"[tfsn] node {self.node_id}: this node's own log passed {MAX_PRINTED_BYTES >> 20} MiB: its "
                  "lines are no longer copied here (the job's log has them: tfsn logs)", flush=True)
        with self._lock:
            self.tail.append(line)
            if len(self._pending) == self._pending.maxlen:   # its oldest line goes: sent already, or lost
                if self._in_flight:
                    self._in_flight -= 1
                else:
                    self._lost += 1
            self._pending.append(line)

    def flush(self, timeout: float = 5.0) -> None:
        """Post the oldest pending lines. One flush at a time: the agent's last flush ran beside the background one,
        both posted the same lines (its 'attempt N ended' twice in the job's log) and both removed them, the second
        taking lines never sent."""
        with self._flushing:
            self._flush(timeout)

    def drain(self, within_s: float) -> None:
        """Post every pending line, batch after batch, for at most `within_s` seconds: as the agent goes (one flush
        sent one batch, and the rest was lost)."""
        deadline = time.monotonic() + within_s
        while self._pending and (left := deadline - time.monotonic()) > 0:
            with self._flushing:
                before = len(self._pending)
                self._flush(min(5.0, left))
            if len(self._pending) >= before:
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))   # the controller is busy: again soon

    def _flush(self, timeout: float) -> None:
        with self._lock:
            lost = self._lost
            lines, size = [], 0
            for line in itertools.islice(self._pending, LOG_BATCH_LINES):
                line = line[:LOG_LINE_CHARS]
                size += len(json.dumps(line))   # as sent: escapes can make a line 6x its characters
                if lines and size > LOG_BATCH_BYTES:
                    break
                lines.append(line)
            self._in_flight = len(lines)
        if not lines:
            return
        # the lines dropped unsent were the oldest: the gap is just before these
        gap = [f"[tfsn] node {self.node_id}: {lost} lines of output dropped here (printed faster than they could "
               "be sent)"] if lost else []
        try:
            self.client.post(self.path, {"lines": gap + lines}, timeout=timeout)
        except ControllerUnavailable:     # kept for the next try; those a full buffer dropped meanwhile are lost
            with self._lock:
                self._lost += len(lines) - self._in_flight
                self._in_flight = 0
            return
        except ControllerRejected:
            pass         # refused for good (the job ended): not sent again, or nothing after it would be
        with self._lock:     # those of them that a full buffer dropped meanwhile are gone already
            self._lost -= lost
            for _ in range(min(self._in_flight, len(self._pending))):
                self._pending.popleft()
            self._in_flight = 0

    def _loop(self) -> None:
        while True:
            time.sleep(0.5)
            self.flush()


def _env_with_python(extra: dict[str, str]) -> dict[str, str]:
    """The node's environment plus `extra`, with this interpreter's directory first on PATH, so that
    `python` in the job's commands is the one tfsn runs under (its virtualenv, with torch)."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return {**os.environ, **extra, "PATH": path}


def node_workdir(job_workdir: str) -> str:
    """Where the job's commands run on this node: its own copy of the code (TFSN_WORKDIR, set by a VM's boot
    script), else the job's workdir itself (a local node shares this machine's)."""
    return os.environ.get("TFSN_WORKDIR") or job_workdir


def install_plan(workdir: str, env: dict[str, str]) -> str:
    """The search entries of the job's plan that came with its code (a cloud node's archive, PLAN_FOLDER)
    into the cache of workers with environment `env`, so that a worker on the planned hardware searches nothing:
    what was done, for the job's log ("" where nothing came). A failure is said, and the workers search."""
    shipped = Path(workdir, PLAN_FOLDER)
    if not shipped.is_dir():
        return ""
    try:
        installed = install_search_entries(shipped, env)
    except OSError as err:
        return f"the job's plan was not installed ({err.strerror or err}); its workers search their step here"
    return f"{installed} search entries of the job's plan installed in {cache_dir(env)}"


def gpu_source(node_id: str) -> tuple[NvmlSource | DcgmSource | None, list[str]]:
    """NVML when this node has NVIDIA GPUs, else a dcgm-exporter at TFSN_DCGM_URL if set, else none;
    and what the agent must say about it. NVML that fails to start leaves the node without device
    samples (said, not fatal: the workers train the same); a GPU whose Xids NVML will not report is said."""
    url = os.environ.get("TFSN_DCGM_URL")
    if not NvmlSource.available():
        return (DcgmSource(url, node_id) if url else None), []
    try:
        source = NvmlSource(node_id)
    except TelemetryError as err:
        return (DcgmSource(url, node_id) if url else None), [
            f"running without GPU telemetry from NVML ({err})" + (f"; reading dcgm-exporter at {url}" if url else
                                                                   "; no clocks, ECC or Xids from this node")]
    return source, [f"Xid events of GPU {gpu} are not watched (NVML: {why}): an Xid there goes unseen"
                    for gpu, why in source.unwatched.items()]


def _one_prefix(line: str) -> str:
    """`[rank0]: [rank0]: X` (torchrun's prefix over torch's own, on a worker's stderr) as `[rank0]: X`."""
    match = _RANK_PREFIX.match(line)
    return line if match is None else match.group(2).strip() + " " + line[match.end():]


def _where(lines: list[str], error_at: int, workdir: str | None) -> str:
    """Where the error at `lines[error_at]` was raised, as ' (at FILE:LINE)': the innermost frame of its traceback
    in the job's workdir (relative to it), else the innermost frame; '' where the lines show none."""
    rank = _RANK_PREFIX.match(lines[error_at])
    frames = []
    for line in reversed(lines[:error_at]):
        if rank is not None and not line.startswith(rank.group(2)):
            break                                    # the traceback is the rank's lines just above its error
        if "Traceback (most recent call last)" in line or "exception was the direct cause" in line:
            break
        found = _FRAME.search(line)
        if found:
            frames.append((found.group(1), found.group(2)))
    root = os.path.join(os.path.abspath(workdir), "") if workdir else None
    mine = [(path, n) for path, n in frames if root and os.path.abspath(path).startswith(root)]
    path, n = (mine or frames or [("", "")])[0]
    if not path:
        return ""
    return f" (at {os.path.relpath(path, root) if mine else path}:{n})"


def failure_summary(lines: list[str], returncode: int, workdir: str | None = None) -> tuple[str, int | None]:
    """The user-facing error of a failed run and the signal that killed the first worker, if any.

    torchrun prints a "Root Cause (first observed failure)" block naming the first rank to fail, with an `exitcode`
    that is negative when a signal killed it (128+N when it killed a command the worker's bash ran, which bash
    reported). The error is the last `SomethingError: ...` line that rank printed (not its peers' "Connection closed
    by peer" after it; any rank's where it printed none); else (bash's "command not found", python's "can't open
    file", a script's own message before `sys.exit(3)`) the worker's exit code and the last line the workers printed.
    """
    sig, code, first = None, returncode, None
    for i, line in enumerate(lines):
        if "Root Cause" in line:
            match = next((m for m in map(_EXITCODE.search, lines[i:]) if m), None)
            if match and int(match.group(1)) < 0:
                sig = -int(match.group(1))
            elif (match and SHELL_SIGNALED < int(match.group(1)) <= SHELL_SIGNALED + 64
                  and any(map(_SHELL_KILLED.search, lines))):
                sig = int(match.group(1)) - SHELL_SIGNALED     # bash's code for a command a signal killed
            elif match:
                code = int(match.group(1))
            rank = next((m for m in map(_ROOT_RANK.match, lines[i:]) if m), None)
            first = f"[rank{rank.group(1)}]:" if rank else None
    errors = [i for i in range(len(lines) - 1, -1, -1) if _ERROR_LINE.search(lines[i])
              and "ChildFailedError" not in lines[i] and "torch.distributed.elastic" not in lines[i]]
    error_at = next((i for i in errors if first and lines[i].startswith(first)), errors[0] if errors else None)
    error = "" if error_at is None else _one_prefix(lines[error_at].strip()) + _where(lines, error_at, workdir)
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return f"a worker was killed by {name}" + (f" ({error.strip()})" if error else ""), sig
    if error:
        return error.strip(), None
    last = next((_one_prefix(line.strip()) for line in reversed(lines) if _WORKER_LINE.match(line)), "")
    return f"workers exited with code {code}" + (f"; their last line: {last}" if last else ""), None


def route_address(url: str) -> str:
    """This machine's address on the route to `url` (a UDP connect sends nothing); '' if unknown."""
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return ""


class Agent:
    def __init__(self, client: ControllerClient, node_id: str) -> None:
        self.client = client
        self.node_id = node_id
        self.logs = LogShipper(client, node_id)
        self.state = "starting"           # starting -> setup -> ready
        self.proc: subprocess.Popen | None = None
        self._pump_thread: threading.Thread | None = None
        self.attempt = 0                  # the attempt `proc` runs
        self.workdir: str | None = None   # where it runs: a failure's frames there are the user's code
        self.done: set[int] = set()       # attempts that ended here (reported or queued)
        self.reports: list[dict[str, Any]] = []
        self._stopping = False
        self._stop_deadline = 0.0         # when stopping workers get SIGKILL
        self.leaving = False              # out of its loop: stopping the workers and sending its last lines
        self.gpus, notes = gpu_source(node_id)
        for note in notes:
            self.logs.add(f"[tfsn] node {node_id}: {note}")
        self.addr = route_address(client.url)   # where the other nodes' workers reach this one
        # The machine under this node, for the health policy's exclusions: a provider that runs nodes
        # inside something (a pod on a Kubernetes node) sets TFSN_HOST_NAME to that something's name.
        self.host = os.environ.get("TFSN_HOST_NAME") or socket.gethostname()
        # This node's GPU series for a Prometheus that scrapes nodes directly (the controller serves
        # the whole job's): on TFSN_AGENT_METRICS_PORT when set.
        self.metrics = Metrics()
        port = os.environ.get("TFSN_AGENT_METRICS_PORT")
        if port:
            served = self.metrics.serve(int(port))
            self.logs.add(f"[tfsn] node {node_id}: metrics on http://127.0.0.1:{served}/metrics")

    def _sample_gpus(self) -> None:
        """Send this node's GPU clocks, throttle reasons, ECC and Xid events to the controller."""
        try:
            samples = self.gpus.sample()
        except TelemetryError as err:
            self.logs.add(f"[tfsn] node {self.node_id}: GPU telemetry stopped: {err}")
            self.gpus = None
            return
        for sample in samples:
            self.metrics.observe(os.environ.get("TFSN_JOB_ID", ""), sample)
        for start in range(0, len(samples), SAMPLES_PER_POST):   # an Xid storm goes in several posts
            chunk = [dataclasses.asdict(s) for s in samples[start:start + SAMPLES_PER_POST]]
            try:
                self.client.post(f"/nodes/{self.node_id}/samples", {"samples": chunk})
            except ControllerRejected as err:   # samples the controller cannot take are lost, not the node
                self.logs.add(f"[tfsn] node {self.node_id}: GPU samples refused: {err}")

    # ---- workers ------------------------------------------------------------------------------
    def _start(self, cmd: dict[str, Any]) -> None:
        torchrun = torchrun_command(cmd)
        env = _env_with_python({**cmd["env"], "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "})
        installed = install_plan(node_workdir(cmd["workdir"]), env)
        if installed:
            self.logs.add(f"[tfsn] node {self.node_id}: {installed}")
        self.logs.add(f"[tfsn] node {self.node_id}: starting attempt {cmd['attempt']} as node rank "
                      f"{cmd['node_rank']} of {cmd['nnodes']}")
        self.proc = subprocess.Popen(torchrun, cwd=node_workdir(cmd["workdir"]), env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.attempt = cmd["attempt"]
        self.workdir = node_workdir(cmd["workdir"])
        self._stopping = False
        self._pump_thread = threading.Thread(target=self._pump, args=(self.proc,), daemon=True)
        self._pump_thread.start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if not self._stopping:  # torchrun's traceback for the SIGTERM we sent is noise
                # torch prefixes a worker's uncaught exception with its rank, as torchrun does every worker line
                self.logs.add(_TWO_PREFIXES.sub(r"\1", line))

    def stop_workers(self) -> None:
        """Stop the running workers and wait until they are gone (see `begin_stop`)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.begin_stop()
        try:
            self.proc.wait(max(0.0, self._stop_deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._kill_leftovers()

    def begin_stop(self) -> None:
        """Ask the running workers to stop, without waiting: torchrun forwards SIGTERM to them; the loop SIGKILLs
        them after a grace period (`_enforce_stop`) and heartbeats meanwhile, so that a node whose workers take
        their grace is not failed for its silence."""
        if self.proc is None or self.proc.poll() is not None or self._stopping:
            return
        self._stopping = True
        self._stop_deadline = time.monotonic() + STOP_GRACE_S
        self.proc.send_signal(signal.SIGTERM)

    def _enforce_stop(self) -> None:
        """SIGKILL workers still running past their stop's grace."""
        if self._stopping and self.proc is not None and self.proc.poll() is None \
                and time.monotonic() >= self._stop_deadline:
            self.proc.kill()
            self.proc.wait()

    def _kill_leftovers(self) -> None:
        """torchrun starts workers in sessions of their own: any it left behind would hold on to memory and keep
        reporting as this attempt."""
        for pid in pids_with_env(TFSN_NODE_ID=self.node_id, TFSN_ATTEMPT=str(self.attempt)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _collect(self) -> None:
        """If the workers ended, queue the attempt's report."""
        self._enforce_stop()
        if self.proc is None or self.proc.poll() is None:
            return
        if self._stopping:
            self._kill_leftovers()
        rc = self.proc.returncode
        self._pump_thread.join(timeout=5)  # torchrun's root-cause block comes last: read it all
        summary, sig = failure_summary(list(self.logs.tail), rc, self.workdir) if rc != 0 else ("", None)
        self.reports.append({"attempt": self.attempt, "returncode": rc, "signal": sig,
                             "stopped": self._stopping, "summary": summary})
        self.logs.add(f"[tfsn] node {self.node_id}: attempt {self.attempt} ended with code {rc}"
                      + (" (stopped by the controller)" if self._stopping else ""))
        self.done.add(self.attempt)
        self.proc = None

    # ---- setup --------------------------------------------------------------------------------
    def _setup(self, script: str, workdir: str) -> None:
        self.state = "setup"

        def run() -> None:
            if script.strip():
                self.logs.add(f"[tfsn] node {self.node_id}: running setup")
                env = {k: v for k, v in _env_with_python({}).items() if k != "TFSN_TOKEN"}  # not the agent's
                proc = subprocess.Popen(["bash", "-c", script], cwd=workdir, env=env,
                                        stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for line in proc.stdout:
                    self.logs.add(f"[setup] {line}")
                if proc.wait() != 0:    # its code and what it said last (a failed command says nothing, a pip
                    tail = [line.removeprefix("[setup] ") for line in self.logs.tail   # error its last lines)
                            if line.startswith("[setup]")][-5:]
                    self.reports.append({"attempt": 0, "returncode": proc.returncode, "signal": None,
                                         "stopped": False, "summary": f"setup exited with code {proc.returncode}"
                                         + (f"; its last lines: {' | '.join(tail)}" if tail else "")})
                    self.state = "setup-failed"
                    return
            self.state = "ready"

        threading.Thread(target=run, name="tfsn-setup", daemon=True).start()

    # ---- the loop -----------------------------------------------------------------------------
    def _send_reports(self) -> None:
        while self.reports:
            self.client.post(f"/nodes/{self.node_id}/result", self.reports[0])
            self.reports.pop(0)

    def _obey(self, cmd: dict[str, Any]) -> bool:
        """Act on the controller's command; False when the agent must exit."""
        action = cmd.get("action")
        if action == "exit":
            return False
        if action == "setup" and self.state == "starting":
            self._setup(cmd.get("setup", ""), node_workdir(cmd.get("workdir", ".")))
        elif action == "idle":
            self.begin_stop()
        elif action == "run" and cmd["attempt"] not in self.done:
            if self.proc is not None and self.attempt != cmd["attempt"]:
                self.begin_stop()    # the new attempt starts at a heartbeat after these workers are gone
            elif self.proc is None:
                # the command itself (with the job's environment) is asked for once, not sent in heartbeats
                full = self.client.post(f"/nodes/{self.node_id}/attempt", {"attempt": cmd["attempt"]})
                if full.get("action") != "run":
                    return self._obey(full)
                self._start(full)
        return True

    def run(self) -> int:
        last_heartbeat = last_gpu_sample = 0.0
        unreachable_since: float | None = None
        while True:
            self._collect()
            now = time.monotonic()
            period = HEARTBEAT_S if self.proc is not None else IDLE_POLL_S
            if now - last_heartbeat >= period or self.reports:
                try:
                    self._send_reports()
                    cmd = self.client.post(f"/nodes/{self.node_id}/heartbeat",
                                           {"state": self.state, "attempt": self.attempt if self.proc else None,
                                            "addr": self.addr, "host": self.host})
                    unreachable_since = None
                    last_heartbeat = now
                    if not self._obey(cmd):
                        break
                    if self.gpus is not None and now - last_gpu_sample >= GPU_SAMPLE_S:
                        last_gpu_sample = now
                        self._sample_gpus()
                except ControllerUnavailable:
                    unreachable_since = unreachable_since or now
                    last_heartbeat = now  # back off to the heartbeat interval
                    if self.proc is None and now - unreachable_since > ORPHAN_EXIT_S:
                        self.logs.add(f"[tfsn] node {self.node_id}: controller unreachable, exiting")
                        break
                except ControllerRejected as err:  # the job is gone or the token is wrong
                    self.logs.add(f"[tfsn] node {self.node_id}: {err}; exiting")
                    break
            time.sleep(TICK_S)
        self.leave()
        return 0

    def leave(self) -> None:
        """Stop the workers, report how their attempt ended and send the lines held, once: at the loop's end, or
        where a SIGTERM cut the loop short."""
        if self.leaving:
            return
        self.leaving = True
        self.stop_workers()
        self._collect()
        self.logs.drain(LAST_LINES_S)


def main() -> int:
    client = ControllerClient.from_env()
    node_id = os.environ.get("TFSN_NODE_ID")
    if client is None or not node_id:
        print("tfsn agent: error: TFSN_CONTROLLER_URL, TFSN_TOKEN, TFSN_JOB_ID and TFSN_NODE_ID must be set; "
              "the agent is started by a provider, not by hand", file=sys.stderr)
        return 2
    agent = Agent(client, node_id)

    # A SIGTERM from the provider stops the workers and sends the lines held before the agent goes. The provider
    # repeats it (the local one every 0.1 s): once the agent is going, a post it cut short would be sent twice.
    def terminated(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not agent.leaving:
            sys.exit(0)
    signal.signal(signal.SIGTERM, terminated)
    try:
        return agent.run()
    finally:
        agent.leave()

