"""What the controller serves to cloud nodes as they boot: a wheel of the very tfsn it runs, and each job's
code archive (codesync.py). Both are files under `$TFSN_HOME/artifacts`, named by their sha256, so a node
verifies what it got and a file is never packed or built twice.

The wheel is built once per tfsn version and source: from the source tree this controller runs (`pip
wheel --no-deps` of a copy of it, so the tree is left as it was), or, where tfsn was installed from a
wheel, repacked from the installed distribution's own files.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from orchestrator.control.codesync import pack
from orchestrator.home import PRIVATE_DIR, PRIVATE_FILE, atomic_write_text

DIGEST_CHARS = 64
PROJECT_ROOT = Path(__file__).resolve().parents[2]
# What a wheel of tfsn is built from (pyproject.toml's packages, its module and its readme).
SOURCE_PARTS = ("pyproject.toml", "README.md", "tfsn.py", "orchestrator", "optimizer", "health", "providers", "configs")
BUILD_TIMEOUT_S = 600.0


class ArtifactError(Exception):
    """A wheel or an archive could not be made; the message says how to fix it."""


@dataclass(frozen=True)
class Wheel:
    name: str      # the wheel's file name (pip reads the name and version from it)
    sha256: str


class Artifacts:
    """The content-addressed files of `home`, and the controller's own wheel (built on first use)."""

    def __init__(self, home: Path) -> None:
        self.folder = home / "artifacts"
        self._wheel: Wheel | None = None
        self._lock = threading.Lock()
        # Archives packed (in a worker) and not yet recorded on their job: `prune` leaves them, though no active job
        # names them yet (or only an ended job does: a relaunch of the same code packs the same digest).
        self._unrecorded: dict[str, int] = {}
        self._packing = threading.Lock()

    def _ready(self) -> Path:
        self.folder.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        return self.folder

    def path(self, digest: str) -> Path | None:
        """The file with sha256 `digest`, if there is one."""
        if len(digest) != DIGEST_CHARS or not all(c in "0123456789abcdef" for c in digest):
            return None
        path = self.folder / digest
        return path if path.is_file() else None

    def add_code(self, workdir: Path, plan: Sequence[Path] = ()) -> str:
        """Pack `workdir` (codesync.pack: ignore files, size cap), with the search entries `plan`, and keep the
        archive; its sha256. It is kept from `prune` until `settled` says its job names it (or never will)."""
        folder = self._ready()
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".code-", delete=False) as out:
            try:
                digest = pack(workdir, out, plan=plan)
            except BaseException:
                os.unlink(out.name)
                raise
        os.chmod(out.name, PRIVATE_FILE)
        with self._packing:
            self._unrecorded[digest] = self._unrecorded.get(digest, 0) + 1
            os.replace(out.name, folder / digest)
        return digest

    def settled(self, digest: str) -> None:
        """The archive `add_code` returned is on its job now, or no job will take it: `prune` decides for it again."""
        with self._packing:
            left = self._unrecorded.get(digest, 0) - 1
            if left > 0:
                self._unrecorded[digest] = left
            else:
                self._unrecorded.pop(digest, None)

    @property
    def wheel_digest(self) -> str | None:
        """The sha256 of the wheel built so far (None before the first cloud node needed one)."""
        return self._wheel.sha256 if self._wheel else None

    def wheel(self) -> Wheel:
        """tfsn's wheel for the nodes: built once per version and source, then taken from the folder."""
        with self._lock:
            if self._wheel is None:
                self._wheel = self._cached_or_built()
            return self._wheel

    def _cached_or_built(self) -> Wheel:
        folder = self._ready()
        tree = PROJECT_ROOT if (PROJECT_ROOT / "pyproject.toml").is_file() else None
        version = _version()
        key = folder / f"wheel-{version}-{_source_digest(tree)[:16]}.json" if tree else None
        if key is not None and key.is_file():
            wheel = Wheel(**json.loads(key.read_text()))
            if self.path(wheel.sha256) is not None:
                return wheel
        with tempfile.TemporaryDirectory(prefix="tfsn-wheel-") as scratch:
            built = _build_from_source(tree, Path(scratch)) if tree else repack_installed(Path(scratch))
            data = built.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            (folder / f".{digest}.tmp").write_bytes(data)
            os.replace(folder / f".{digest}.tmp", folder / digest)
        wheel = Wheel(built.name, digest)
        if key is not None:
            atomic_write_text(key, json.dumps(wheel.__dict__))
        return wheel

    def prune(self, keep: set[str]) -> None:
        """Delete the code archives that no job needs any more (`keep`: the digests still wanted); wheels stay, and
        so do archives packed and not yet recorded."""
        if not self.folder.is_dir():
            return
        wheels = {json.loads(p.read_text()).get("sha256") for p in self.folder.glob("wheel-*.json")}
        with self._packing:
            for path in self.folder.iterdir():
                if len(path.name) == DIGEST_CHARS and path.name not in (
                        keep | wheels | {self.wheel_digest} | self._unrecorded.keys()):
                    path.unlink(missing_ok=True)


def _version() -> str:
    try:
        return importlib.metadata.version("tfsn")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def _source_files(tree: Path) -> list[Path]:
    files = []
    for part in SOURCE_PARTS:
        path = tree / part
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
        files += [p for p in found if "__pycache__" not in p.parts and p.suffix != ".pyc"
                  and not any(x.endswith(".egg-info") for x in p.parts)]
    return files


def _source_digest(tree: Path) -> str:
    digest = hashlib.sha256()
    for path in _source_files(tree):
        digest.update(str(path.relative_to(tree)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _build_from_source(tree: Path, scratch: Path) -> Path:
    """`pip wheel --no-deps` of a copy of the source tree (a build in place would leave build/ behind)."""
    copy = scratch / "src"
    for path in _source_files(tree):
        target = copy / path.relative_to(tree)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "--quiet", "--disable-pip-version-check",
               "-w", str(scratch / "dist"), str(copy)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ArtifactError(f"building tfsn's wheel for the nodes took over {BUILD_TIMEOUT_S:.0f}s. To fix: "
                            "set TFSN_INSTALL_SPEC to a tfsn the nodes can pip install") from None
    wheels = sorted((scratch / "dist").glob("tfsn-*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no wheel was written"])[-1]
        raise ArtifactError(f"cannot build tfsn's wheel for the nodes from {tree}: {last}. To fix: pip install "
                            "setuptools in the controller's environment, or set TFSN_INSTALL_SPEC to a tfsn the "
                            "nodes can pip install")
    return wheels[0]


def repack_installed(scratch: Path, name: str = "tfsn") -> Path:
    """A wheel of an installed pure-Python distribution's own files (tfsn installed from a wheel: no source
    tree), written into `scratch`."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise ArtifactError(f"{name} is neither a source tree nor an installed distribution here. To fix: pip "
                            f"install {name}'s source, or set TFSN_INSTALL_SPEC") from None
    stem = f"{name.replace('-', '_')}-{dist.version}"
    info = f"{stem}.dist-info"
    path = scratch / f"{stem}-py3-none-any.whl"
    records = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for file in sorted(dist.files or [], key=str):
            member = file.as_posix()
            if (member.startswith(("../", "/")) or "__pycache__" in member or member.endswith(".pyc")
                    or member in {f"{info}/{n}" for n in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")}):
                continue   # scripts (pip makes them from the entry points) and the installer's own records
            data = Path(file.locate()).read_bytes()
            wheel.writestr(member, data)
            hashed = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{member},sha256={hashed},{len(data)}")
        wheel.writestr(f"{info}/RECORD", "\n".join(records + [f"{info}/RECORD,,"]) + "\n")
    return path
