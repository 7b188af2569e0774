"""The job's code for nodes that do not share this machine: its workdir packed into one archive.

What goes in follows the workdir's ignore files: `.tfsnignore` files when the workdir has one at its top,
else `.gitignore` files (gitignore syntax, each file for the paths under its own folder; `.git` itself is
always left out). The archive is deterministic (sorted entries, no times, owners or umask in it, gzip
without a timestamp), so the same tree always has the same sha256: it is content-addressed, packed once
per launch, and every node of the job (replacements too) unpacks the same bytes. Files above the size
cap are refused with one line that names the size, the cap and how to leave files out. The search cache entries of
the job's plan go in too, under the reserved folder PLAN_FOLDER: a node's agent installs them into its workers' cache.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

from optimizer.cache import PLAN_FOLDER

MAX_CODE_BYTES_ENV = "TFSN_CODE_MAX_MB"
DEFAULT_MAX_CODE_MB = 100           # what `pip install`-sized code is; data belongs in a bucket
# a repository's history is not the job's code; PLAN_FOLDER, the archive's reserved folder for the job's plan, is tfsn's
ALWAYS_LEFT_OUT = (".git", PLAN_FOLDER)


class CodeSyncError(Exception):
    """The workdir cannot be shipped as it is (too large, unreadable); the message says how to fix it."""


@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern[str]   # matched against the path relative to the ignore file's folder
    base: str                  # that folder, relative to the workdir ("" for the top)
    negated: bool
    dir_only: bool


def _glob_regex(glob: str) -> str:
    """A gitignore glob as a regex: `*` and `?` stay within one path part, `**` spans parts."""
    out, i = [], 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("/**", i) and i + 3 == len(glob):
            out.append("/.*")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        elif glob[i] == "[" and "]" in glob[i + 2:]:
            end = glob.index("]", i + 2)
            body = glob[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        elif glob[i] == "\\" and i + 1 < len(glob):
            out.append(re.escape(glob[i + 1]))
            i += 2
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return "".join(out)


def parse_ignore(text: str, base: str = "") -> list[_Rule]:
    """The rules of one ignore file in folder `base` (gitignore syntax: `#` comments, `!` re-includes,
    a trailing `/` matches folders only, a `/` elsewhere anchors the pattern to `base`)."""
    rules = []
    for line in text.splitlines():
        line = line.rstrip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        line = line[1:] if negated else line
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        body = _glob_regex(line.lstrip("/"))
        regex = body if anchored else f"(?:.*/)?{body}"
        rules.append(_Rule(re.compile(regex + r"\Z", re.DOTALL), base, negated, dir_only))
    return rules


def _ignored(rules: list[_Rule], path: str, is_dir: bool) -> bool:
    """Whether the last rule that matches `path` (relative to the workdir) leaves it out."""
    verdict = False
    for rule in rules:
        if rule.base and not path.startswith(rule.base + "/"):
            continue
        relative = path[len(rule.base) + 1:] if rule.base else path
        if (is_dir or not rule.dir_only) and rule.pattern.match(relative):
            verdict = not rule.negated
    return verdict


def ignore_file_name(workdir: Path) -> str:
    """`.tfsnignore` where the workdir has one at its top, else `.gitignore`."""
    return ".tfsnignore" if (workdir / ".tfsnignore").is_file() else ".gitignore"


def included_files(workdir: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every path of the workdir that the archive holds (relative, '/'-separated, sorted), with its lstat:
    folders left out are not walked (as git, a file under an ignored folder cannot be brought back)."""
    name = ignore_file_name(workdir)

    def walk(folder: Path, relative: str, rules: list[_Rule]) -> Iterator[tuple[str, os.stat_result]]:
        ignore = folder / name
        if ignore.is_file():
            rules = rules + parse_ignore(_read_ignore(ignore), relative)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as err:
            raise CodeSyncError(f"workdir: cannot read {folder} ({err.strerror}). To fix: make it readable "
                                f"or list it in {workdir / name}") from None
        for entry in entries:
            path = f"{relative}/{entry.name}" if relative else entry.name
            info = entry.stat(follow_symlinks=False)
            is_dir = stat.S_ISDIR(info.st_mode)
            if entry.name in ALWAYS_LEFT_OUT or _ignored(rules, path, is_dir):
                continue
            if not (is_dir or stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
                continue   # sockets, fifos, devices: nothing a node can use
            yield path, info
            if is_dir:
                yield from walk(Path(entry.path), path, rules)

    yield from walk(workdir, "", [])


def _read_ignore(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError as err:
        raise CodeSyncError(f"cannot read {path} ({err.strerror}). To fix: make it readable") from None


def max_code_bytes() -> int:
    """The size cap of a job's code: TFSN_CODE_MAX_MB (MiB), default DEFAULT_MAX_CODE_MB."""
    raw = os.environ.get(MAX_CODE_BYTES_ENV, "")
    try:
        megabytes = float(raw) if raw else DEFAULT_MAX_CODE_MB
    except ValueError:
        raise CodeSyncError(f"{MAX_CODE_BYTES_ENV}={raw!r} is not a number. To fix: set it to a size in MiB, "
                            f"e.g. {DEFAULT_MAX_CODE_MB}") from None
    return int(megabytes * 2**20)


def _size_text(size: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return ""


def check_size(workdir: Path, limit: int | None = None) -> int:
    """The bytes of files the archive would hold; CodeSyncError naming the size, the cap, the largest
    top-level entries and how to leave them out when that is over the cap."""
    limit = max_code_bytes() if limit is None else limit
    total, by_top = 0, {}
    for path, info in included_files(workdir):
        if stat.S_ISREG(info.st_mode):
            total += info.st_size
            top = path.split("/")[0] + ("/" if "/" in path else "")
            by_top[top] = by_top.get(top, 0) + info.st_size
    if total > limit:
        largest = ", ".join(f"{name} ({_size_text(size)})" for name, size in
                            sorted(by_top.items(), key=lambda item: -item[1])[:3])
        raise CodeSyncError(
            f"workdir: {workdir} holds {_size_text(total)} of files to send to the nodes, over the cap of "
            f"{_size_text(limit)} (largest: {largest}). To fix: list what the nodes do not need in "
            f"{workdir / ignore_file_name(workdir)} (gitignore syntax, e.g. data/ or *.pt), or raise "
            f"{MAX_CODE_BYTES_ENV}")
    return total


def _entry(workdir: Path, path: str, info: os.stat_result, name: str = "") -> tarfile.TarInfo:
    """A tar entry (named `name`, else `path`) with nothing of this machine in it: no times, owners or umask (only
    the exec bit)."""
    entry = tarfile.TarInfo(name or path)
    entry.mtime, entry.uid, entry.gid, entry.uname, entry.gname = 0, 0, 0, "", ""
    if stat.S_ISDIR(info.st_mode):
        entry.type, entry.mode = tarfile.DIRTYPE, 0o755
    elif stat.S_ISLNK(info.st_mode):   # kept a link, as git keeps it
        entry.type, entry.mode, entry.linkname = tarfile.SYMTYPE, 0o777, os.readlink(workdir / path)
    else:
        entry.mode, entry.size = (0o755 if info.st_mode & stat.S_IXUSR else 0o644), info.st_size
    return entry


def _add(archive: tarfile.TarFile, workdir: Path, path: str, info: os.stat_result, name: str = "") -> None:
    entry = _entry(workdir, path, info, name)
    if not entry.isfile():
        archive.addfile(entry)
        return
    try:
        with open(workdir / path, "rb") as data:
            archive.addfile(entry, data)
    except (OSError, tarfile.ReadError) as err:   # unreadable, or it shrank while it was packed
        raise CodeSyncError(f"workdir: cannot pack {workdir / path} ({getattr(err, 'strerror', None) or err}). "
                            f"To fix: make it readable and keep it still during the launch, or list it in "
                            f"{workdir / ignore_file_name(workdir)}") from None


def pack(workdir: Path, out: BinaryIO, limit: int | None = None, plan: Sequence[Path] = ()) -> str:
    """Write the workdir's archive (tar.gz) to `out` and return its sha256; CodeSyncError if over the cap. The files
    `plan` (search cache entries) go under PLAN_FOLDER, by their names; one that is gone is left out."""
    workdir = Path(workdir)
    check_size(workdir, limit)
    found = []
    for entry in sorted({Path(p) for p in plan}, key=lambda p: p.name):
        try:
            found.append((entry, entry.stat()))
        except OSError:
            continue   # gone from the cache: the node's workers search that graph

    digest = hashlib.sha256()

    class _Hashing(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data: bytes) -> int:   # type: ignore[override]
            digest.update(data)
            out.write(data)
            return len(data)

    with gzip.GzipFile(fileobj=_Hashing(), mode="wb", mtime=0, filename="", compresslevel=6) as zipped, \
            tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path, info in included_files(workdir):
            _add(archive, workdir, path, info)
        if found:
            archive.addfile(_entry(workdir, PLAN_FOLDER, os.stat(workdir)))
        for entry, info in found:
            _add(archive, entry.parent, entry.name, info, f"{PLAN_FOLDER}/{entry.name}")
    return digest.hexdigest()
