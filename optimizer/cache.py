"""Content-addressed compile cache on disk.

An artifact's name is the hash of everything that decides its bytes (source, schedule,
hardware, compiler and flags), so a second run of the same model compiles nothing, and an
artifact is never stale. Writes go to a private temp file and are renamed into place, so
concurrent processes never see a half-written artifact (at worst both compile, one rename wins).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Callable, Mapping

STATS = {"hits": 0, "builds": 0}


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """$TFSN_CACHE (in `env`, default this process's environment), else the `default_cache_dir`."""
    chosen = (os.environ if env is None else env).get("TFSN_CACHE")
    return Path(chosen).expanduser() if chosen else default_cache_dir(str(Path("~/.cache/tfsn").expanduser()))


@functools.lru_cache(maxsize=None)
def default_cache_dir(home_cache: str) -> Path:
    """`home_cache` (~/.cache/tfsn), else, where it cannot be made or written, this user's folder in the temp
    folder, said once. Why: a container run as another user (`docker run --user 1000`: HOME=/) or a read-only
    home made the first step of `tfsn.optimize(model)` fail ("PermissionError: '/.cache'") before any kernel."""
    path = Path(home_cache)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK | os.X_OK):
            return path
        why = "not writable"
    except OSError as e:
        why = f"{type(e).__name__}: {e}"
    fallback = Path(tempfile.gettempdir()) / f"tfsn-cache-{os.getuid()}"
    logging.getLogger("tfsn.optimizer").warning(
        "tfsn: the compile cache %s cannot be used (%s); using %s, which a reboot may empty: set TFSN_CACHE to a "
        "writable folder to keep compiled kernels", path, why, fallback)
    return fallback


def search_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the optimizer keeps its search decisions, one file per content key (backend.search_cache_path)."""
    return cache_dir(env) / "search"


# Where a job's code archive holds the search entries of its plan (`tfsn plan` searched its step): a cloud node's
# agent installs them into its workers' cache (install_search_entries), so that they search nothing
PLAN_FOLDER = ".tfsn-plan"
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.json")


def install_search_entries(source: Path, env: Mapping[str, str] | None = None) -> int:
    """Copy the search entries in `source` (a job's plan, shipped with its code) into the search cache of processes
    with environment `env`, keeping any entry already there; how many were installed. A name that is not an entry's
    is skipped: workers look entries up by content key, so one made for other hardware is never found, and a
    corrupt one is said and searched again (backend._read_search_entry)."""
    installed = 0
    for path in sorted(source.iterdir()) if source.is_dir() else []:
        target = search_dir(env) / path.name
        if _ENTRY_NAME.fullmatch(path.name) and path.is_file() and not path.is_symlink() and not target.exists():
            atomic_write(target, path.read_bytes())
            installed += 1
    return installed


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
