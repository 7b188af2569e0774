"""Provider calls off the controller's loop, so that a slow or hung cloud never freezes the others' jobs.

Every call to a provider (create, status, terminate, reading its offers) runs in a worker thread of its
provider's lane, with a deadline. The loop starts a call and goes on; at its next pass `collect` hands each
finished call to the callback given at its start, on the loop's own thread, so that only the loop writes
what it decides. One call per key at a time (a node's create and its terminate share one key): a call in
flight is never issued twice, and a node's terminate waits for its create to return.

A call past its deadline is answered with DeadlineError (the offer fails over; a terminate is tried again
later). Python cannot stop its thread: the call keeps its key until it returns, and its late result goes to
its `on_late` callback at the next `collect` (a create's late handle is how its node is deleted: a cloud's
search by tag may not see a fresh machine yet), or is dropped where there is none. Each lane has at most
LANE_THREADS daemon threads: a hung cloud holds its own lane's threads only, its queued calls meet their
deadline unrun, and a hung thread never keeps the controller's process from exiting.
"""
from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from providers.base import ProviderError

LANE_THREADS = 8         # calls of one provider that run at once
# How long the loop lets each kind of call run before it fails it; a driver may set `<kind>_deadline_s`.
DEADLINES_S = {"create": 1200.0, "terminate": 900.0, "status": 120.0, "offers": 300.0}


class DeadlineError(ProviderError):
    """A provider call did not return within its deadline: its offer fails over like on any refusal."""

    scope = "offer"


def deadline_s(provider: object, kind: str) -> float:
    """The deadline of a `kind` call to `provider` (its own `<kind>_deadline_s`, else DEADLINES_S)."""
    return float(getattr(provider, f"{kind}_deadline_s", DEADLINES_S[kind]))


@dataclass(eq=False)
class Call:
    """One provider call: what it runs, what the loop does with its end, and how far it got."""

    key: Hashable
    lane: str                                   # the provider it calls
    what: str                                   # for messages: "aws: create of node n3"
    run: Callable[[], Any]
    on_done: Callable[[Call], None]
    limit_s: float                              # its deadline, from when it was asked for (queueing counts)
    wakes: bool = True                          # its end wakes the loop (a status poll waits for the next pass)
    on_late: Callable[[Call], None] | None = None   # what the loop does with a result that came past the deadline
    state: str = "queued"                       # queued | running | done | handed (to on_done or on_late) |
                                                # cancelled (before it ran) | abandoned (past its deadline: on_done
                                                # had a DeadlineError; it may still be running) | late (returned
                                                # after that, for on_late: it keeps its key until handed)
    value: Any = None
    error: BaseException | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def deadline(self) -> float:
        """When it must have returned (time.monotonic())."""
        return self.started + self.limit_s


class ProviderCalls:
    """The calls in flight, by key; the lanes that run them (see the module docstring)."""

    def __init__(self, wake: threading.Event, lane_threads: int = LANE_THREADS) -> None:
        self.wake = wake
        self.lane_threads = lane_threads
        self._calls: dict[Hashable, Call] = {}
        self._lanes: dict[str, _Lane] = {}
        self._changed = threading.Condition()
        self._local = threading.local()         # `waiting` is per thread: the loop's own calls never wait

    def busy(self, key: Hashable) -> bool:
        """Whether a call with this key is in flight (or past its deadline and not yet returned)."""
        with self._changed:
            return key in self._calls

    def in_flight(self) -> int:
        """Calls queued or running within their deadline."""
        with self._changed:
            return sum(call.state in ("queued", "running") for call in self._calls.values())

    def start(self, key: Hashable, lane: str, what: str, run: Callable[[], Any], deadline: float,
              on_done: Callable[[Call], None], wakes: bool = True,
              on_late: Callable[[Call], None] | None = None) -> bool:
        """Run `run` in `lane` within `deadline` seconds; `on_done(call)` gets its value or error at the loop's next
        `collect` (before `start` returns, inside `waiting`), and `on_late(call)` what it returned after its
        deadline, if it did. False, and nothing started, while `key` is busy."""
        call = Call(key, lane, what, run, on_done, deadline, wakes, on_late)
        with self._changed:
            if key in self._calls:
                return False
            self._calls[key] = call
            if lane not in self._lanes:
                self._lanes[lane] = _Lane(lane, self.lane_threads, self._work)
            self._lanes[lane].put(call)
        if getattr(self._local, "waiting", False):
            with self._changed:
                self._changed.wait_for(lambda: call.state not in ("queued", "running"),
                                       timeout=max(0.0, call.deadline - time.monotonic()))
            self._finish([call], expire=True)
        return True

    def cancel(self, key: Hashable) -> bool:
        """Drop the call with this key if it has not started (its callback is not called): a create queued for a
        node the job no longer wants. False if there is none, or it runs already."""
        with self._changed:
            call = self._calls.get(key)
            if call is None or call.state != "queued":
                return False
            call.state = "cancelled"
            del self._calls[key]
            self._changed.notify_all()
            return True

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Calls started by this thread inside are waited for (up to their deadline) and their callbacks run before
        `start` returns: how a caller outside the loop (tests, a debugging session) takes one step to its end."""
        before = getattr(self._local, "waiting", False)
        self._local.waiting = True
        try:
            yield
        finally:
            self._local.waiting = before

    def collect(self) -> None:
        """On the loop's thread: the callback of every call that returned or passed its deadline."""
        with self._changed:
            due = list(self._calls.values())
        self._finish(due)

    def settle(self, timeout_s: float) -> bool:
        """Collect until no call is queued or running (True), or `timeout_s` passed (False): what the controller
        does on its way out, so that calls about to end are recorded; a hung call is left to its daemon thread."""
        end = time.monotonic() + timeout_s
        while True:
            self.collect()
            with self._changed:
                if not any(c.state in ("queued", "running") for c in self._calls.values()):
                    return True
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.05))

    def _finish(self, calls: list[Call], expire: bool = False) -> None:
        """Hand each call that ended (or passed its deadline: all of them if `expire`) to its callback; one failing
        callback stops no other."""
        now = math.inf if expire else time.monotonic()
        ended = []
        with self._changed:
            for call in calls:
                if call.state == "late":
                    self._calls.pop(call.key, None)
                    call.state = "handed"
                    ended.append((call, call.on_late))
                    continue
                if call.state == "done":
                    self._calls.pop(call.key, None)
                    call.state = "handed"          # to its callback, once
                elif call.state in ("queued", "running") and now > call.deadline:
                    call.error = DeadlineError(f"{call.what} did not return within {call.limit_s:g}s",
                                               provider=call.lane)
                    if call.state == "queued":     # never started: its thread will skip it
                        self._calls.pop(call.key, None)
                    call.state = "abandoned"       # a running one keeps its key until it returns
                else:
                    continue
                ended.append((call, call.on_done))
        for call, callback in ended:
            try:
                callback(call)
            except Exception:   # one broken callback must not stop the others, nor the loop
                print(f"{call.what}: handling its result failed\n{traceback.format_exc()}", flush=True)

    def _work(self, call: Call) -> None:
        """A lane's thread: run one call, unless it passed its deadline while queued."""
        with self._changed:
            if call.state != "queued":
                return
            call.state = "running"
        try:
            value, error = call.run(), None
        except BaseException as err:   # handed to the loop, which decides what it means
            value, error = None, err
        with self._changed:
            if call.state == "abandoned" and call.on_late is not None:   # for the loop's next collect
                call.value, call.error, call.state = value, error, "late"
            elif call.state == "abandoned":        # the loop gave up on it: its key is free again
                if self._calls.get(call.key) is call:
                    del self._calls[call.key]
            if call.state in ("abandoned", "late"):
                print(f"{call.what} returned after its deadline "
                      f"({time.monotonic() - call.started:.0f}s){f': {error}' if error else ''}", flush=True)
            else:
                call.value, call.error, call.state = value, error, "done"
            self._changed.notify_all()
        if call.wakes or call.state in ("abandoned", "late"):
            self.wake.set()


class _Lane:
    """One provider's queue and its worker threads (daemons, started as calls come, at most `size`)."""

    def __init__(self, name: str, size: int, work: Callable[[Call], None]) -> None:
        self.name = name
        self.size = size
        self.work = work
        self.queue: queue.SimpleQueue[Call] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.idle = 0
        self._lock = threading.Lock()

    def put(self, call: Call) -> None:
        self.queue.put(call)
        with self._lock:
            if self.queue.qsize() > self.idle and len(self.threads) < self.size:
                thread = threading.Thread(target=self._serve, name=f"tfsn-{self.name}-{len(self.threads)}", daemon=True)
                self.threads.append(thread)
                thread.start()

    def _serve(self) -> None:
        while True:
            with self._lock:
                self.idle += 1
            call = self.queue.get()
            with self._lock:
                self.idle -= 1
            self.work(call)
