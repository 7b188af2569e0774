"""Where checkpoints live: a folder (local or a shared mount) or an object store (s3://, gs://, az://).

Both keep one rule: a checkpoint is visible only once complete, and its manifest says so.
- A folder: DCP writes into a ``.tmp-*`` sibling, the manifest is written and fsynced, then one rename
  puts the whole directory in place.
- An object store has no rename: DCP writes into ``step_N/`` itself and the manifest, one PUT, is
  written last. Readers take a ``step_N/`` without a manifest for a half-written one and skip it.
- A step saved again (a job restored from step N saves N once more, or `save` is called twice for one
  step): the newest save wins, but the committed copy is never taken away before the new one is committed.
  DCP writes the new copy beside it, into ``step_N/data-<nonce>/``; replacing the manifest, which
  names that folder, is the commit (a rename in a folder, one PUT on an object store); only then are
  the older copy's files removed. A crash at any point leaves step N whole, old or new; files of an
  interrupted save left inside ``step_N/`` are listed by no manifest and go with the next save of N, or
  when N is pruned.
Object stores go through fsspec (s3fs, gcsfs, adlfs: the cloud extras) and DCP's FsspecWriter/Reader;
credentials and endpoints come from each cloud's own configuration (AWS_ENDPOINT_URL and the like), or from
the identity the VM runs as (providers/identity.py).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from orchestrator.spec import CHECKPOINT_URL_SCHEMES, checkpoint_url_scheme

MANIFEST = "tfsn-manifest.json"
DATA_PREFIX = "data-"   # a re-saved step's DCP files are in step_N/data-<nonce>/ (see the module's docstring)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 22
# adlfs is anonymous unless told otherwise (AZURE_STORAGE_ANON, default true) and then never asks the machine's
# managed identity (DefaultAzureCredential) for a token; a checkpoint container is written to, never public.
_STORAGE_OPTIONS = {"az": {"anon": False}}

Location = Path | str  # a Path in a folder, a URL on an object store


class StorageUnavailable(Exception):
    """The checkpoint storage cannot be used from this process; the message says how to fix it."""


def step_of(location: Location) -> int:
    match = _STEP_DIR.match(_name(location))
    return int(match.group(1)) if match else -1


def _name(location: Location) -> str:
    return str(location).rstrip("/").rsplit("/", 1)[-1]


class FolderStore:
    """Checkpoints in a folder: atomic by rename, durable by fsync."""

    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory)

    def child(self, parent: Location, name: str) -> Path:
        return Path(parent) / name

    def step_dirs(self) -> list[Location]:
        """``step_*`` directories, highest step first; ``.tmp-*`` leftovers are never listed."""
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
        return sorted(dirs, key=step_of, reverse=True)

    def begin(self, final: Location, nonce: str) -> tuple[Path, str]:
        """Where DCP writes the checkpoint that becomes `final` (rank 0, before any rank writes), and that
        folder's name inside `final` ("" when the whole folder is renamed into place)."""
        final = Path(final)
        if (final / MANIFEST).is_file():   # committed: it stays until the new copy beside it is
            written, data = final / f"{DATA_PREFIX}{nonce}", f"{DATA_PREFIX}{nonce}"
        else:
            self.remove(final)   # half-written or damaged, if there at all: nothing committed to keep
            written, data = self.root / f".tmp-{final.name}-{nonce}", ""
        written.mkdir(parents=True, exist_ok=True)
        return written, data

    def prepare(self, location: Location) -> None:
        """Make `location` writable from this rank (every rank, after `begin`)."""
        Path(location).mkdir(parents=True, exist_ok=True)

    def files(self, location: Location) -> list[str]:
        base = Path(location)
        return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())

    def read_bytes(self, path: Location) -> bytes:
        return Path(path).read_bytes()

    def open(self, path: Location) -> Any:
        return open(path, "rb")

    def sizes(self, location: Location, names: list[str]) -> dict[str, int]:
        """Bytes of each named file that exists."""
        return {n: (Path(location) / n).stat().st_size for n in names if (Path(location) / n).is_file()}

    def commit(self, written: Location, final: Location, manifest: bytes, data: str) -> None:
        """A new step: the manifest written durably into `written`, then one rename puts it in place. A step saved
        again (`data`): its manifest replaced by one rename."""
        written, final = Path(written), Path(final)
        if data:
            _fsync_dir(written)   # its files' entries, and its own, on the disk before the manifest that names them
            _fsync_dir(final)
            _write_durably(final / MANIFEST, manifest)
        else:
            _write_durably(written / MANIFEST, manifest)
            os.replace(written, final)
            _fsync_dir(final.parent)

    def remove_replaced(self, final: Location, data: str) -> None:
        """After a step saved again is committed: everything in it but its manifest and its `data` folder."""
        for entry in list(Path(final).iterdir()):
            if entry.name not in (MANIFEST, data):
                self.remove(entry)

    def remove(self, location: Location) -> None:
        """A checkpoint, a folder or a file; nothing if it is not there."""
        if Path(location).is_dir():
            shutil.rmtree(location, ignore_errors=True)
        elif Path(location).exists():
            os.remove(location)

    def remove_stale(self, before: float) -> None:
        """Temp directories of saves that started before `before` and never finished."""
        for tmp in self.root.glob(".tmp-*"):
            if tmp.stat().st_mtime < before:
                shutil.rmtree(tmp, ignore_errors=True)

    def writer(self, location: Location) -> StorageWriter:
        return FileSystemWriter(location)

    def reader(self, location: Location) -> StorageReader:
        return FileSystemReader(location)


class ObjectStore:
    """Checkpoints under an s3://, gs:// or az:// prefix: the manifest, written last, is the commit."""

    def __init__(self, url: str) -> None:
        scheme = checkpoint_url_scheme(url) or url.partition("://")[0]
        url = f"{scheme}://{url.partition('://')[2]}"   # S3:// is s3:// (schemes are case-insensitive; fsspec's are not)
        # The driver's options, for the store and DCP's writer and reader alike; an explicit AZURE_STORAGE_ANON wins.
        self.options = {} if scheme == "az" and "AZURE_STORAGE_ANON" in os.environ else _STORAGE_OPTIONS.get(scheme, {})
        try:
            from fsspec.core import url_to_fs

            self.fs, _ = url_to_fs(url, **self.options)
        except ImportError as err:
            extra = CHECKPOINT_URL_SCHEMES.get(scheme, "all")
            raise StorageUnavailable(f"checkpoint.dir {url}: {scheme}:// needs a driver that is not installed "
                                     f"({err}). To fix: pip install 'tfsn[{extra}]'") from None
        self.scheme = scheme
        self.root = url.rstrip("/")

    def child(self, parent: Location, name: str) -> str:
        return f"{str(parent).rstrip('/')}/{name}"

    def step_dirs(self) -> list[Location]:
        self.fs.invalidate_cache()   # other ranks and processes write here: never trust a cached listing
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        dirs = [self._url(e["name"]) for e in entries
                if e.get("type") == "directory" and _STEP_DIR.match(_name(e["name"]))]
        return sorted(dirs, key=step_of, reverse=True)

    def begin(self, final: Location, nonce: str) -> tuple[str, str]:
        """Where DCP writes: `final` itself when nothing is committed there (a half-written one is emptied first),
        else a folder inside it, beside the committed copy (its name is the second value; see the module)."""
        self.fs.invalidate_cache()
        if self.fs.exists(self.child(final, MANIFEST)):
            return self.child(final, f"{DATA_PREFIX}{nonce}"), f"{DATA_PREFIX}{nonce}"
        if self.fs.exists(final):
            self.fs.rm(str(final), recursive=True)
        return str(final), ""

    def prepare(self, location: Location) -> None:
        """Nothing: object stores have no folders to create."""

    def files(self, location: Location) -> list[str]:
        self.fs.invalidate_cache()
        prefix = self.fs._strip_protocol(str(location)).rstrip("/") + "/"
        return sorted(p[len(prefix):] for p in self.fs.find(str(location)) if p.startswith(prefix))

    def read_bytes(self, path: Location) -> bytes:
        return self.fs.cat_file(str(path))

    def open(self, path: Location) -> Any:
        return self.fs.open(str(path), "rb", block_size=_CHUNK)

    def sizes(self, location: Location, names: list[str]) -> dict[str, int]:
        self.fs.invalidate_cache()
        prefix = self.fs._strip_protocol(str(location)).rstrip("/") + "/"
        found = self.fs.find(str(location), detail=True)
        return {p[len(prefix):]: int(info["size"]) for p, info in found.items() if p[len(prefix):] in names}

    def commit(self, written: Location, final: Location, manifest: bytes, data: str) -> None:
        """The manifest, one PUT: there or not, never half (a step saved again, `data`, included)."""
        self.fs.pipe_file(self.child(final, MANIFEST), manifest)

    def remove_replaced(self, final: Location, data: str) -> None:
        """After a step saved again is committed: everything in it but its manifest and its `data` folder."""
        self.fs.invalidate_cache()
        for entry in self.fs.ls(str(final), detail=False):
            if _name(entry) not in (MANIFEST, data):
                self.remove(self._url(entry))

    def remove(self, location: Location) -> None:
        try:
            self.fs.rm(str(location), recursive=True)
        except FileNotFoundError:
            pass

    def remove_stale(self, before: float) -> None:
        """Nothing: a half-written ``step_N/`` is a step directory, pruned or overwritten with the others."""

    def writer(self, location: Location) -> StorageWriter:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # sync_files would call os.sync() (a stream has no fileno): an object is durable once closed.
        return FsspecWriter(str(location), sync_files=False, **self.options)

    def reader(self, location: Location) -> StorageReader:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(str(location), **self.options)

    def _url(self, path: str) -> str:
        return f"{self.scheme}://{path.rstrip('/')}"


Store = FolderStore | ObjectStore


def open_store(directory: str | Path) -> Store:
    """The store for a checkpoint directory or URL; StorageUnavailable when its driver is missing."""
    if isinstance(directory, str) and checkpoint_url_scheme(directory):
        return ObjectStore(directory)
    return FolderStore(directory)


def _write_durably(path: Path, data: bytes) -> None:
    """`path` holds `data` or what it held before, even across a crash: written beside it, fsynced, renamed."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
