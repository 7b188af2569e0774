"""The Python SDK used inside training scripts: `tfsn.init()` and its `Run`.

Three or four lines added to an ordinary loop give a job checkpoint-restart and telemetry:

    run = tfsn.init()
    start = run.restore(model=model, optimizer=opt)
    for step in run.steps(start, total_steps):
        ...
        run.log(loss=loss)
        run.checkpoint(model=model, optimizer=opt)

Launched by tfsn, settings come from the job spec (through TFSN_* variables); run as a plain
`python train.py` it trains and checkpoints locally with no controller. Telemetry goes to the
controller from a background thread in batches; a step never waits for the network.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import numbers
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from orchestrator.sdk import checkpoint as ckpt
from orchestrator.sdk import commtimer, phases
from orchestrator.sdk.asyncsave import AsyncSaver, PendingSave
from orchestrator.sdk.client import (METRIC_NAME_CHARS, METRICS_MAX, SKIPPED_CHARS, SKIPPED_MAX, TELEMETRY_BYTES_MAX,
                                     TELEMETRY_RECORDS_MAX, ControllerClient, ControllerRejected, ControllerUnavailable)
from orchestrator.spec import CHECKPOINT_URL_SCHEMES, checkpoint_url_scheme, parse_duration

SYNC_EVERY = 10             # time-based checkpoint decisions are taken together by all ranks this often
AUTO_FIRST_S = 300.0        # `auto`: first checkpoint after this long, before the save cost is known
AUTO_BOUNDS_S = (30.0, 1800.0)
LOGGED_MAX = METRICS_MAX - 2  # a step's metrics from run.log: room left for a save's checkpoint_stall_s and _wait_s
POST_SPARE_BYTES = 64 * 1024  # a telemetry post's body besides its records (heartbeat, phase): far less
NODE_MTBF_H = 6000.0        # `auto`: mean time between failures of one 8-GPU node (Llama 3 report: 419
                            # interruptions in 54 days on 16,384 GPUs = ~50,700 GPU-hours per interruption)


class TelemetryReporter:
    """Batches step records and events and posts them from a daemon thread.

    Bounded and never blocking the caller; what the controller did not take is kept and sent
    again, oldest first in posts within the route's caps (a backlog of minutes is several MiB), so a
    controller restarting mid-run loses nothing short of max_buffer records. At exit it keeps trying for
    EXIT_FLUSH_S, so the last steps of a run still reach a controller that is coming back.
    """

    EXIT_FLUSH_S = 30.0

    def __init__(self, client: ControllerClient, rank: int, attempt: int, flush_s: float = 1.0,
                 max_buffer: int = 10000, clock: phases.PhaseClock | None = None) -> None:
        self.client, self.rank, self.attempt, self.flush_s = client, rank, attempt, flush_s
        self.phases = clock or phases.PhaseClock()
        self._records: deque[tuple[int, dict[str, Any]]] = deque(maxlen=max_buffer)  # (sequence, record)
        self._sequence = 0
        self._events: deque[tuple[str, dict[str, Any]]] = deque(maxlen=1000)
        self._lock = threading.Lock()
        self._flushing = threading.Lock()   # one flush at a time: two read the same records and both sent them
        self._wake = threading.Event()
        self._closed = False
        self.step = -1                      # the step running now, sent with every heartbeat
        self.checkpoint_request = 0.0       # id (a time) of the controller's newest "checkpoint now"
        self.checkpoint_honoured = 0.0      # id of the newest request a save has answered
        self._thread = threading.Thread(target=self._loop, name="tfsn-telemetry", daemon=True)
        self._thread.start()

    def add(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._sequence += 1
            self._records.append((self._sequence, record))

    def event(self, path: str, body: dict[str, Any]) -> None:
        """A message that must arrive in order (checkpoint saved or restored)."""
        with self._lock:
            self._events.append((path, body))
        self._wake.set()

    def flush(self, timeout: float = 5.0, until: float | None = None) -> bool:
        """Send what is pending, oldest first, in posts the controller's route takes; True when nothing is left.
        With `until` (a time.monotonic()), it waits for another flush and starts a post only until then."""
        if not self._flushing.acquire(timeout=-1 if until is None else max(0.0, until - time.monotonic())):
            return False
        try:
            return self._flush(timeout, until)
        finally:
            self._flushing.release()

    def _flush(self, timeout: float, until: float | None) -> bool:
        try:
            while self._events:
                path, body = self._events[0]
                self.client.post(path, body, timeout=timeout)
                with self._lock:
                    self._events.popleft()
            with self._lock:
                pending = list(self._records)
            # The phases finished since the last flush go with the first post (back to the clock if it fails).
            finished: dict[str, float] | None = self.phases.take()
            for batch in _batches(pending):
                if finished is None and until is not None and time.monotonic() > until:
                    return False   # at exit, out of time: a backlog to a slow controller, one post after another
                try:
                    self._post([record for _, record in batch], finished or {}, timeout)
                except ControllerUnavailable:
                    if finished is not None:
                        self.phases.give_back(finished)
                    raise
                except ControllerRejected as err:
                    if err.status not in (400, 413) or not batch:   # not about these records: the job is gone
                        raise
                    print(f"tfsn: the controller refused {len(batch)} step record(s), steps {batch[0][1]['step']} "
                          f"to {batch[-1][1]['step']} (dropped; the heartbeats go on): {err}",
                          file=sys.stderr, flush=True)
                    if finished is not None:   # refused for its records (run.phase checks the names): sent next time
                        self.phases.give_back(finished)
                finished = None
                with self._lock:  # drop what was sent, even if the bounded buffer moved on meanwhile
                    while batch and self._records and self._records[0][0] <= batch[-1][0]:
                        self._records.popleft()
        except ControllerUnavailable:
            return False
        except ControllerRejected:  # the job is gone: nobody will ever take these
            with self._lock:
                self._events.clear()
                self._records.clear()
        return True

    def _post(self, records: list[dict[str, Any]], finished: dict[str, float], timeout: float) -> None:
        # Sent every flush even with no records: the heartbeat that tells a stuck rank from a
        # rank blocked in a collective, which keeps heartbeating from this thread; with the phase
        # it is in (a long save is not a hang) and how long the phases finished since took.
        phase, since = self.phases.now()
        body = {"rank": self.rank, "attempt": self.attempt, "records": records, "heartbeat": time.time(),
                "step": self.step if self.step >= 0 else None, "phase": phase, "phase_since": since, "phases": finished}
        answer = self.client.post("/telemetry", body, timeout=timeout)
        self.checkpoint_request = max(self.checkpoint_request, float(answer.get("checkpoint") or 0.0))

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            try:
                self.flush()
            except Exception as err:  # this thread is the rank's heartbeat: it must not die
                print(f"tfsn: telemetry error (continuing): {err!r}", flush=True)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)
        deadline = time.monotonic() + self.EXIT_FLUSH_S
        while not self.flush(timeout=2, until=deadline) and time.monotonic() < deadline:
            time.sleep(1)


class Run:
    """One process's view of the job: its rank, its checkpoints and its telemetry."""

    def __init__(self, *, checkpoint_dir: str | Path, checkpoint_interval: int | str, keep: int,
                 total_steps: int | None, async_save: bool = False) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.job_id = os.environ.get("TFSN_JOB_ID")
        self.attempt = int(os.environ.get("TFSN_ATTEMPT", 1))
        url = isinstance(checkpoint_dir, str) and checkpoint_url_scheme(checkpoint_dir)
        if isinstance(checkpoint_dir, str) and "://" in checkpoint_dir and not url:
            # as a path, "ftp://host/x" would be a local folder "ftp:" beside the script, found missing at restore
            raise ValueError(f"checkpoint_dir {checkpoint_dir!r}: tfsn saves checkpoints to a folder or to "
                             f"{', '.join(f'{s}://' for s in CHECKPOINT_URL_SCHEMES)} URLs. To fix: use one of those")
        ckpt.check_keep(keep)        # here, not at the first save minutes into the run
        self.checkpoint_dir: str | Path = checkpoint_dir if url else Path(checkpoint_dir)
        self.keep = keep
        self.total_steps = total_steps
        self.interval_steps, self.interval_s = _parse_interval(checkpoint_interval)
        self.last_checkpoint: ckpt.CheckpointInfo | None = None
        self.step = -1      # the step being run (0-based); before the loop, the last one done (-1 none; restored-1)
        self._restored = 0      # the step restored (0 none): a save is due only once a step past it ran
        self._in_step = False   # a step began and was not recorded: the loop raised or broke out of it
        self._metrics: dict[str, Any] = {}
        self._logged: dict[str, None] = {}  # the names run.log attached to the step not yet recorded
        self._last_save = time.monotonic()
        self._save_cost: float | None = None   # seconds the last save stalled the step, for `auto`
        self._write_s: float | None = None     # seconds the last save took to be written and committed
        self._saver = AsyncSaver() if async_save else None
        self._write: phases.Entered | None = None   # the phase of the save in flight (a background write)
        self._comm_timer: commtimer.CommTimer | None = None
        self._sync_wait = 0.0   # seconds this step waited in the SDK's own all-reduce (the checkpoint vote)
        self._phases = phases.PhaseClock()
        phases.activate(self._phases)
        client = ControllerClient.from_env()
        self._telemetry = TelemetryReporter(client, self.rank, self.attempt, clock=self._phases) if client else None
        # At exit, before Python stops starting threads (`atexit` runs after: the last write could no longer
        # hash its files and was lost); private, but it is how concurrent.futures waits for its own work.
        threading._register_atexit(self._finish_at_exit)   # type: ignore[attr-defined]

    @property
    def managed(self) -> bool:
        """Launched by a tfsn controller (telemetry on) rather than run by hand."""
        return self._telemetry is not None

    # ---- the loop -----------------------------------------------------------------------------
    def steps(self, start: int, total: int | None = None) -> Iterator[int]:
        """Yield step indices start..total-1, timing each step and reporting it."""
        total = total if total is not None else self.total_steps
        if total is None:
            raise ValueError("run.steps() needs the total number of steps: pass it, or set `steps` in train.yaml")
        self.total_steps = total
        for step in range(start, total):
            self.step, self._in_step = step, True
            if self._telemetry is not None:
                self._telemetry.step = step
            began = time.perf_counter()
            if self._comm_timer is not None:
                self._comm_timer.step_started()
            yield step
            self._record(step, time.perf_counter() - began)
            self._in_step = False

    def log(self, **metrics: Any) -> None:
        """Attach metrics (numbers or one-element tensors) to the current step. A number is any real one: NumPy's
        scalars too (`np.float32`, `np.int64`: a metric from a NumPy array or scikit-learn), taken as a float."""
        for key, value in metrics.items():
            # here, not at the API: it refused the whole post, the rank's heartbeat with it, at every flush
            if len(key) > METRIC_NAME_CHARS:
                raise ValueError(f"run.log({key}=...): a metric name is at most {METRIC_NAME_CHARS} characters, this "
                                 f"one has {len(key)}. To fix: give it a shorter name")
            if any("\ud800" <= char <= "\udfff" for char in key):    # JSON sends it, the API refuses it as no text
                raise ValueError(f"run.log({ascii(key)}=...): a metric name is Unicode text, this one holds a lone "
                                 "surrogate (bytes decoded with surrogateescape: a file name). To fix: decode it "
                                 "with errors='replace'")
            if key not in self._logged and len(self._logged) >= LOGGED_MAX:
                raise ValueError(f"run.log({key}=...): a step has at most {LOGGED_MAX} metrics, and this one has "
                                 f"{LOGGED_MAX} already. To fix: log fewer (a mean or a histogram of several)")
            self._metrics[key] = _metric(key, value)
            self._logged[key] = None

    def _record(self, step: int, seconds: float) -> None:
        metrics, self._metrics, self._logged = self._metrics, {}, {}
        # Time waiting for other ranks is not this rank's work: in DDP's all-reduce and in the vote.
        # On CUDA the compute time is measured on the device and read later (see `commtimer`).
        vote, self._sync_wait = self._sync_wait, 0.0
        if self._comm_timer is not None:
            compute = self._comm_timer.take_compute(seconds, vote)
        else:
            compute = max(0.0, seconds - vote) if vote else None
        if self._telemetry is not None:
            record = {"step": step, "at": time.time(), "step_time": seconds, "metrics": metrics}
            if compute is not None:
                record["compute_time"] = compute
            self._telemetry.add(record)

    def watch(self, model: torch.nn.Module) -> None:
        """Measure this rank's wait in `model`'s gradient all-reduce, so that a slow rank can be told
        from the ranks waiting for it (see `commtimer`). `restore()` calls it for a DDP model, also one in
        `tfsn.optimize`'s (torch.compile's) wrapper; call it yourself before the first backward pass if you
        do not restore. A model on a GPU is timed on the device with CUDA events (with NCCL the CPU cannot
        see the wait). The timer is a comm hook, and DDP takes one: a hook of your own (PowerSGD, compression,
        DDP's mixed_precision) registered before is kept, untimed; one registered after is refused by DDP."""
        ddp = _data_parallel(model)
        if ddp is None or self._comm_timer is not None or not self.managed:
            return
        if getattr(ddp, "_comm_hooks", None):     # DDP takes one: ours would fail, 'can only be called once'
            print("tfsn: the all-reduce is not timed: the DDP model has a comm hook of its own (DDP takes one), "
                  "so a slow rank cannot be told from those waiting for it", file=sys.stderr, flush=True)
            return
        self._comm_timer = commtimer.install(ddp)

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """`with run.phase("eval"):` tells the controller that this rank evaluates (or loads data, or
        saves) rather than trains, so that a long evaluation is not taken for a hang; see `phases`."""
        return self._phases.phase(name)

    # ---- checkpoints --------------------------------------------------------------------------
    def checkpoint(self, force: bool = False, **objects: Any) -> ckpt.CheckpointInfo | PendingSave | None:
        """Save `objects` (model, optimizer, anything with state_dict) when a checkpoint is due.

        Call it every step, on every rank: it is a collective when it saves. Due: every
        `interval` steps, or when the time-based interval has passed (decided by all ranks together
        every SYNC_EVERY steps), and always after the last step. An asynchronous save returns a
        PendingSave at once (see asyncsave); a synchronous one the CheckpointInfo once written.
        The seconds the step spent here are logged as its `checkpoint_stall_s` metric (of which
        `checkpoint_wait_s` waited for the previous save to be written).
        """
        # Before the loop, the steps restored (none: 0, not 1, which a resume took as step 0 done, and skipped it),
        # saved only when forced: the restored step is in its checkpoint already.
        completed = self.step + 1
        if not (force or (completed > self._restored and self._due(completed))):
            return None
        started = time.monotonic()
        with self._phases.phase(phases.CHECKPOINT):
            if self._saver is None:
                result: ckpt.CheckpointInfo | PendingSave = ckpt.save(self.checkpoint_dir, completed, objects,
                                                                      keep=self.keep)
                self._saved(result)
            else:
                waited = time.monotonic()
                self._wait_for_write()   # the previous write's end is announced before this one's start
                self._metrics["checkpoint_wait_s"] = time.monotonic() - waited
                self._write = write = self._phases.enter(phases.CHECKPOINT_WRITE, background=True)
                try:
                    result = self._saver.save(self.checkpoint_dir, completed, objects, keep=self.keep,
                                              done=functools.partial(self._written, write))
                except BaseException:
                    self._phases.leave(write)
                    raise
        self._last_save = time.monotonic()
        self._save_cost = self._last_save - started
        self._metrics["checkpoint_stall_s"] = self._save_cost
        return result

    def _wait_for_write(self, saver: AsyncSaver | None = None) -> None:
        """Wait for the save in flight (closing `saver` when given); meanwhile the rank is in its write's phase."""
        with self._phases.joined(self._write):
            if saver is not None:
                saver.close()   # raises the CheckpointError of a failed last save
            elif self._saver is not None:
                self._saver.wait()

    def _written(self, write: phases.Entered, info: ckpt.CheckpointInfo | None) -> None:
        """A background save is over (None: it failed); in the writer thread."""
        self._phases.leave(write)
        self._saved(info)

    def _saved(self, info: ckpt.CheckpointInfo | None) -> None:
        """A save is committed (None: it failed)."""
        if info is None:
            return
        self.last_checkpoint, self._write_s = info, info.seconds
        if self._telemetry is not None and self.rank == 0:
            self._telemetry.event("/checkpoint", {"step": info.step, "path": str(info.path), "seconds": info.seconds})

    def on_phase(self, listener: Callable[[str, bool], None]) -> None:
        """Call `listener(name, started)` as phases start and end: "checkpoint" while the training thread
        is in a save, "checkpoint-write" while a save is written in the background (called from the writer
        thread at its end), and every phase announced with `run.phase` or `phases.phase`. The same
        announcements the controller's hang detection gets (see `phases`); for profilers, say."""
        self._phases.listen(listener)

    def restore(self, **objects: Any) -> int:
        """Load the newest valid checkpoint into `objects`; returns the step to start from (0 if none)."""
        for value in objects.values():
            self.watch(value)
        if self._saver is not None:
            with self._phases.phase(phases.CHECKPOINT):
                self._wait_for_write()
        skipped: list[str] = []     # why newer checkpoints were passed over: said once, in the job's events too
        info = ckpt.restore(self.checkpoint_dir, objects, skipped)
        for reason in skipped:
            print(f"tfsn: skipping checkpoint: {reason}", file=sys.stderr, flush=True)
        if self._telemetry is not None and self.rank == 0:   # nothing restored is said too: a restart from step 0
            self._telemetry.event("/checkpoint", {           # is no resume (every checkpoint may have been corrupt)
                "step": info.step if info else 0, "path": str(info.path if info else self.checkpoint_dir),
                "restored": True, "skipped": [" ".join(r.split())[:SKIPPED_CHARS] for r in skipped[:SKIPPED_MAX]]})
        if info is None:
            return 0
        self.last_checkpoint, self.step, self._restored = info, info.step - 1, info.step
        return info.step

    def _due(self, completed: int) -> bool:
        """Whether to save after `completed` steps; the same answer on every rank, or the save hangs.

        Step intervals and the last step need no agreement. Time-based intervals, and the
        controller's "checkpoint now" (seen by each rank at a different moment), are decided by a
        MAX all-reduce: every step under a controller, so a request is honoured at the next step,
        else every SYNC_EVERY steps.
        """
        if self.total_steps is not None and completed >= self.total_steps:
            return True
        if self.interval_steps is not None and completed % self.interval_steps == 0:
            return True
        telemetry = self._telemetry
        request = telemetry.checkpoint_request if telemetry is not None else 0.0
        requested = telemetry is not None and request > telemetry.checkpoint_honoured
        if self.managed:
            vote = requested or (self.interval_steps is None
                                 and time.monotonic() - self._last_save >= self._interval_seconds())
        elif self.interval_steps is None and completed % SYNC_EVERY == 0:
            vote = time.monotonic() - self._last_save >= self._interval_seconds()
        else:
            return False
        if dist.is_initialized() and self.world_size > 1:
            # with the newest request any rank has seen, so that all ranks count it as answered
            flags = torch.tensor([1.0 if vote else 0.0, request], dtype=torch.float64)
            began = time.perf_counter()
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            self._sync_wait += time.perf_counter() - began
            vote, request = bool(flags[0].item()), float(flags[1].item())
        if vote and telemetry is not None:
            telemetry.checkpoint_honoured = max(telemetry.checkpoint_honoured, request)
        return vote

    def _interval_seconds(self) -> float:
        """The fixed interval, or for `auto` Young's optimum sqrt(2 * save cost * MTBF of the job)."""
        if self.interval_s is not None:
            return self.interval_s
        if self._save_cost is None:
            return AUTO_FIRST_S
        nodes = int(os.environ.get("TFSN_NUM_NODES", 1))
        mtbf_s = NODE_MTBF_H * 3600 / nodes
        # The cost is the stall; a background write must also end before the next save, or that one waits.
        optimum = max(math.sqrt(2 * self._save_cost * mtbf_s), self._write_s or 0.0)
        return min(max(optimum, AUTO_BOUNDS_S[0]), AUTO_BOUNDS_S[1])

    def finish(self) -> None:
        """Wait for the last checkpoint to be written, then flush telemetry (also called at exit); metrics logged
        after the last step are said to be unsent (they were dropped, saying nothing)."""
        saver, self._saver = self._saver, None
        try:
            if saver is not None:
                with self._phases.phase(phases.CHECKPOINT):   # a long last write is a save, not a hang
                    self._wait_for_write(saver)
        finally:
            if self._telemetry is not None:
                # metrics go with a step's record: after the last step there is none (in a step left by an
                # exception or a `break`, they were logged in the loop: its traceback, or the break, says why)
                if self._logged and not self._in_step:
                    print(f"tfsn: run.log({', '.join(self._logged)}) after the last step is not "
                          "sent: metrics are sent with a step; log them in run.steps()'s loop", file=sys.stderr,
                          flush=True)
                self._telemetry.close()
                self._telemetry = None

    def _finish_at_exit(self) -> None:
        """`finish` when the script ends without it: a last save that failed fails the process, in one line
        (an exception at exit would be printed with its traceback, and the exit status stay 0)."""
        try:
            self.finish()
        except ckpt.CheckpointError as e:
            print(f"tfsn: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)


def _batches(pending: list[tuple[int, dict[str, Any]]]) -> Iterator[list[tuple[int, dict[str, Any]]]]:
    """`pending` (sequence, record) in order, read (tensors, device timings: here, the step is free), as batches within
    what one telemetry post may hold (records, encoded bytes); one empty batch when there is none: the heartbeat."""
    batch: list[tuple[int, dict[str, Any]]] = []
    size = 0
    for item in pending:
        _read_record(item[1])
        grown = len(json.dumps(item[1])) + 2   # and its ", "
        if batch and (len(batch) == TELEMETRY_RECORDS_MAX or size + grown > TELEMETRY_BYTES_MAX - POST_SPARE_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += grown
    yield batch


def _read_record(record: dict[str, Any]) -> None:
    """Read `record`'s tensors and device timing into numbers, in place. A field that fails to read (a CUDA error) is
    dropped, saying so: left in, it raised at every flush before the post, and the rank's heartbeats stopped with it."""
    metrics = {key: _read_field(record, f"metric {key!r}", functools.partial(float, value))
               for key, value in record["metrics"].items()}
    record["metrics"] = {key: value for key, value in metrics.items() if value is not None}
    if isinstance(record.get("compute_time"), commtimer.PendingCompute):
        seconds = _read_field(record, "compute_time", record["compute_time"].resolve)
        if seconds is None:
            del record["compute_time"]
        else:
            record["compute_time"] = seconds


def _read_field(record: dict[str, Any], name: str, read: Callable[[], float | None]) -> float | None:
    """`read()`, or None with one line on stderr when it raises."""
    try:
        return read()
    except Exception as err:
        print(f"tfsn: step {record['step']}'s {name} is not sent: reading it failed ({type(err).__name__}: {err})",
              file=sys.stderr, flush=True)
        return None


def _metric(key: str, value: Any) -> torch.Tensor | float:
    """`value` as run.log keeps it: a one-element real tensor as it is (read on the telemetry thread, leaving the step
    free), a number as a float, converted here: a float() that failed on the telemetry thread (NumPy's timedelta64 is
    a numbers.Real, 10**400 an int) failed every flush after it, the rank's heartbeats too."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return value.detach()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        with contextlib.suppress(TypeError, OverflowError):
            return float(value)
    raise TypeError(f"run.log({key}=...): expected a number or a one-element tensor, got {type(value).__name__}")


def _data_parallel(model: Any) -> DistributedDataParallel | None:
    """The DDP module `model` is, or that torch.compile wraps (`tfsn.optimize(DDP(net))` is an OptimizedModule
    holding it as `_orig_mod`: taken for no DDP, it went untimed, saying nothing); None for any other object."""
    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, DistributedDataParallel) else None


def _parse_interval(value: int | str) -> tuple[int | None, float | None]:
    """(steps, None), (None, seconds) or (None, None) for `auto`."""
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        steps = int(value)
        if steps < 1:
            raise ValueError(f"checkpoint interval must be >= 1 step, got {steps}")
        return steps, None
    if value == "auto":
        return None, None
    return None, parse_duration(value)


def init(*, checkpoint_dir: str | Path = "checkpoints", checkpoint_interval: int | str = "auto", keep: int = 3,
         steps: int | None = None, async_save: bool = True) -> Run:
    """Start the SDK in this process; joins the torchrun process group when there is one.

    The job spec's settings (passed by the controller as TFSN_* variables) win over these
    arguments, so that `train.yaml` is the one place a launched job is configured.
    """
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            # One GPU per local rank; gloo too, for the SDK's small CPU collectives (the checkpoint vote).
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group("gloo")
    env = os.environ
    total = env.get("TFSN_STEPS")
    return Run(checkpoint_dir=env.get("TFSN_CHECKPOINT_DIR", checkpoint_dir),
               checkpoint_interval=env.get("TFSN_CHECKPOINT_INTERVAL", checkpoint_interval),
               keep=int(env.get("TFSN_CHECKPOINT_KEEP", keep)),
               total_steps=int(total) if total else steps,
               async_save=env.get("TFSN_CHECKPOINT_ASYNC", "1" if async_save else "0") == "1")
