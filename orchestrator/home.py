"""Where tfsn keeps its state on this machine: `$TFSN_HOME` (default `~/.tfsn`).

The store holds every job's secret and the logs may hold what a job printed: the folder is 0700 and the
files tfsn writes there 0600, whether the folder is new or was there before (`private_open`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600


def tfsn_home() -> Path:
    """The state directory, created on first use; this user's only."""
    home = Path(os.environ.get("TFSN_HOME") or Path.home() / ".tfsn").expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    _restrict(home, PRIVATE_DIR)
    return home


def job_dir(job_id: int, home: Path | None = None) -> Path:
    """Per-job files: the job log, node logs, default checkpoints."""
    path = (home or tfsn_home()) / "jobs" / str(job_id)
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    return path


def private_open(path: Path, mode: str = "a", **kwargs: Any) -> IO:
    """`open`, but a file it creates is 0600, and one that was there is made 0600."""
    f = open(path, mode, opener=lambda name, flags: os.open(name, flags, PRIVATE_FILE), **kwargs)
    _restrict(path, PRIVATE_FILE)
    return f


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` (0600) so that readers see the old content or the new, never a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with private_open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _restrict(path: Path, mode: int) -> None:
    if path.stat().st_mode & 0o777 != mode:
        path.chmod(mode)
