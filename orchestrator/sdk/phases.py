"""The phase each training process is in: training steps, or a checkpoint save, an evaluation, data loading.

Why: a save or an evaluation may run for minutes while no step finishes. The controller's hang
detection must know that the job is in such a phase, and how long that phase took before, to tell a
long save from a hang (as NVIDIA's NVRx does with its sections). The SDK sends the phase a rank is in,
and since when, with every heartbeat, and the longest duration of each phase finished since the last
post; the controller learns each phase's timeout from those (health/hang.py).

    with run.phase("eval"):
        evaluate(model)

Entering and leaving a phase costs two clock reads and a lock: cheap enough for every step's data
loading. tfsn's own checkpoint save announces "checkpoint" itself, and "checkpoint-write" while a save is
written in the background (a phase off the training thread: its listeners hear it and its duration is
reported; the rank is in it only while it waits for the write to end, see `joined`). Code that has no `Run` at hand (the checkpoint
module's background save, say) calls `phases.phase("checkpoint")`: the phase of the Run of this process,
or nothing when there is none. Every phase is announced once, here: the heartbeat reads the clock, and
listeners (`run.on_phase`: profilers, a job's own hang watch) hear each start and end from it.
"""
from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

TRAIN = "train"                           # no phase announced: training steps
CHECKPOINT, EVAL, DATA = "checkpoint", "eval", "data"
CHECKPOINT_WRITE = "checkpoint-write"     # a save written in the background (asyncsave)
NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
MAX_PHASES = 16                           # distinct phase names one process may announce


@dataclass(eq=False)
class Entered:
    """One phase entered: its name, when (wall time), whether the training thread is in it, whether it ended."""

    name: str
    since: float
    background: bool
    over: bool = False


class PhaseClock:
    """The phases a process is in (nested: an eval that loads data is in `data` within `eval`), the longest
    duration of each phase finished since the last `take()`, and the listeners that hear them start and end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stack: list[Entered] = []
        self._finished: dict[str, float] = {}
        self._names: set[str] = set()
        self._listeners: list[Callable[[str, bool], None]] = []

    def listen(self, listener: Callable[[str, bool], None]) -> None:
        """Call `listener(name, started)` as each phase starts and ends (from the thread that announces it)."""
        self._listeners.append(listener)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Announce `name` for the duration of the block."""
        entered = self.enter(name)
        try:
            yield
        finally:
            self.leave(entered)

    def enter(self, name: str, *, background: bool = False) -> Entered:
        """Start phase `name`; `background`: work off the training thread, which is not in it."""
        if not isinstance(name, str) or not NAME.match(name) or name == TRAIN:
            raise ValueError(f"run.phase({name!r}): a phase is a short lower-case name such as "
                             f"'{CHECKPOINT}', '{EVAL}' or '{DATA}' (letters, digits, '-' and '_', at most 32)")
        with self._lock:
            if name not in self._names and len(self._names) >= MAX_PHASES:
                raise ValueError(f"run.phase({name!r}): at most {MAX_PHASES} distinct phases per process, "
                                 f"already {sorted(self._names)}")
            self._names.add(name)
            entered = Entered(name, time.time(), background)
            if not background:
                self._stack.append(entered)
        self._announce(name, True)
        return entered

    def leave(self, entered: Entered) -> None:
        """End a phase `enter` started (from any thread)."""
        took = time.time() - entered.since
        with self._lock:
            entered.over = True
            if entered in self._stack:   # a background phase is there while the training thread waits for it
                self._stack.remove(entered)
            self._finished[entered.name] = max(took, self._finished.get(entered.name, 0.0))
        self._announce(entered.name, False)

    @contextlib.contextmanager
    def joined(self, entered: Entered | None) -> Iterator[None]:
        """While the training thread waits for background phase `entered` to end (a save being written), the
        rank is in that phase, since it began: hang detection gives it that phase's timeout, learned from
        how long the phase took before, not the timeout of the phase the wait sits in. Nothing is announced
        again."""
        with self._lock:
            joined = entered is not None and not entered.over
            if joined:
                self._stack.append(entered)
        try:
            yield
        finally:
            if joined:
                with self._lock:
                    if entered in self._stack:
                        self._stack.remove(entered)

    def now(self) -> tuple[str, float | None]:
        """The innermost phase and when it began (`train`, None outside every phase)."""
        with self._lock:
            return (self._stack[-1].name, self._stack[-1].since) if self._stack else (TRAIN, None)

    def take(self) -> dict[str, float]:
        """The longest duration of each phase finished since the last call."""
        with self._lock:
            finished, self._finished = self._finished, {}
        return finished

    def give_back(self, finished: dict[str, float]) -> None:
        """Durations `take()` returned that could not be sent: kept for the next post."""
        with self._lock:
            for name, seconds in finished.items():
                self._finished[name] = max(seconds, self._finished.get(name, 0.0))

    def _announce(self, name: str, started: bool) -> None:
        for listener in self._listeners:
            try:
                listener(name, started)
            except Exception as err:   # an observer must not break training
                print(f"tfsn: phase listener failed (continuing): {err!r}", flush=True)


_active: PhaseClock | None = None


def activate(clock: PhaseClock | None) -> None:
    """Make `clock` the one `phase()` announces in (the Run of this process does this)."""
    global _active
    _active = clock


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Announce `name` in this process's Run, if there is one; else do nothing."""
    clock = _active
    if clock is None:
        yield
        return
    with clock.phase(name):
        yield
