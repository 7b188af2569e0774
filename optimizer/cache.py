"""Content-addressed compile cache on disk.

An artifact's name is the hash of everything that decides its bytes (source, schedule,
hardware, compiler and flags), so a second run of the same model compiles nothing, and an
artifact is never stale. Writes go to a private temp file and are renamed into place, so
concurrent processes never see a half-written artifact (at worst both compile, one rename wins).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable

STATS = {"hits": 0, "builds": 0}


def cache_dir() -> Path:
    """$TFSN_CACHE, else ~/.cache/tfsn."""
    return Path(os.environ.get("TFSN_CACHE") or "~/.cache/tfsn").expanduser()


def content_key(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def get_or_build(key: str, suffix: str, build: Callable[[Path], None]) -> Path:
    """The cached artifact for `key`; `build(tmp_path)` makes it when missing."""
    path = cache_dir() / key[:2] / f"{key}{suffix}"
    if path.exists():
        STATS["hits"] += 1
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=suffix)
    os.close(fd)
    try:
        build(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    STATS["builds"] += 1
    return path
