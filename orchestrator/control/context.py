"""What every part of the controller shares: the store, the job folders, the providers, the API's
address, the loop's wake-up, the metrics, the files cloud nodes fetch, and the one way a job's log and
events are written."""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from health.metrics import Metrics
from orchestrator.control.artifacts import Artifacts
from orchestrator.control.calls import ProviderCalls
from orchestrator.control.store import Job, JobState, Store
from orchestrator.home import job_dir, private_open
from providers.base import Provider
from providers.registry import load_provider


_COLOURS = re.compile(r"\x1b\[[0-9;]*m")
# Line breaks and control characters (tab kept, and ANSI colours matched first so they stay): what a node or a
# user wrote must never start a line of the job's log or of its events, where "[tfsn] ..." lines are ours.
_UNSAFE = re.compile(_COLOURS.pattern + r"|[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def plain(text: str) -> str:
    """`text` without its colour codes (what a `[tfsn]` test must look at)."""
    return _COLOURS.sub("", text)


def one_line(text: str) -> str:
    """`text` as one line: every unsafe character written as its escape (`\\x0a`), colours kept."""
    return _UNSAFE.sub(lambda m: m.group() if len(m.group()) > 1 else m.group().encode("unicode_escape").decode(),
                       text)


@dataclass
class ControlContext:
    store: Store
    home: Path                                     # $TFSN_HOME: each job's folder (logs, local checkpoints)
    providers: dict[str, Provider]                 # loaded on first use by name
    url: str = ""                                  # where agents reach the API; set once the server listens
    trust: dict[str, str] = field(default_factory=dict)   # what agents need to trust it (TLS); none on loopback
    wake: threading.Event = field(default_factory=threading.Event)   # set when the loop should run now
    metrics: Metrics = field(default_factory=Metrics)                 # tfsn_* series, served by the daemon
    _log_lock: threading.Lock = field(default_factory=threading.Lock)
    calls: ProviderCalls = field(init=False)       # every provider call, off the loop (see calls.py)
    artifacts: Artifacts = field(init=False)       # what cloud nodes fetch as they boot: tfsn's wheel, jobs' code

    def __post_init__(self) -> None:
        self.calls = ProviderCalls(self.wake)
        self.artifacts = Artifacts(self.home)

    def provider(self, name: str) -> Provider:
        if name not in self.providers:
            self.providers[name] = load_provider(name)
        return self.providers[name]

    def shares_host(self, provider: str) -> bool:
        """Whether the provider's nodes are processes of this machine (loopback reaches them)."""
        return bool(getattr(self.provider(provider), "shares_host", False))

    def log(self, job_id: int, lines: list[str]) -> None:
        """Append lines to the job's log (agents' output and the controller's own lines share it)."""
        if not lines:
            return
        with self._log_lock, private_open(job_dir(job_id, self.home) / "job.log") as log:
            log.write("".join(one_line(line.rstrip("\n")) + "\n" for line in lines))

    def event(self, job_id: int, kind: str, message: str) -> None:
        """An event in the store (`tfsn status`), also a `[tfsn]` line in the job's log."""
        message = one_line(message)
        self.store.add_event(job_id, kind, message)
        self.log(job_id, [f"[tfsn] {message}"])

    def transition(self, job: Job, new: JobState, message: str = "", **changes: Any) -> None:
        self.store.transition(job.id, new, message, **changes)
        self.log(job.id, [f"[tfsn] job {job.id} {new.value}" + (f": {message}" if message else "")])
