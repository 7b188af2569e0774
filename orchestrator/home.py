"""Where tfsn keeps its state on this machine: `$TFSN_HOME` (default `~/.tfsn`)."""
from __future__ import annotations

import os
from pathlib import Path


def tfsn_home() -> Path:
    """The state directory, created on first use."""
    home = Path(os.environ.get("TFSN_HOME") or Path.home() / ".tfsn").expanduser().resolve()
    if not home.exists():
        home.mkdir(parents=True)
        home.chmod(0o700)  # the store holds every job's secret token: this user only
    return home


def job_dir(job_id: int, home: Path | None = None) -> Path:
    """Per-job files: the job log, node logs, default checkpoints."""
    path = (home or tfsn_home()) / "jobs" / str(job_id)
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` so that readers see the old content or the new, never a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
