"""The spec's `model.entry`, priced per hardware type: runs optimizer.entry in a child process.

The child imports the job's own script, so everything that can go wrong there (a syntax error, a
missing function, a wrong return, training at import, a crash) stays in the child; here it becomes one
line naming `model.entry`, the file and the fix, raised as a PlanError on that field (so `tfsn validate`,
`tfsn plan` and `tfsn launch` all refuse the spec with it). The child is stopped, with everything it
started, at `model.entry_timeout`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from orchestrator.planning.planner import PlanError
from orchestrator.spec import JobSpec

ENTRY_FIELD = ("model", "entry")
# What a user's code can get wrong, and how to fix it (optimizer.entry.STAGES)
_FIX = {"file": "point model.entry at a .py file relative to workdir",
        "import": "make the script importable: keep its training under `if __name__ == \"__main__\":`",
        "function": "define that function in the file, or name another in model.entry",
        "call": "make the function run without the job's environment (no GPU, controller or data download)",
        "shape": "return (model, batch, loss_fn) as the README's train.yaml section shows"}
_STDERR_TAIL = 4096     # bytes of the child's stderr kept for a crash's message
# A workdir with more Python than this is not hashed for the result cache (each plan then runs the child)
_HASHED_FILES, _HASHED_BYTES = 2000, 64 << 20


@dataclass(frozen=True)
class HardwareStep:
    """One hardware type's searched step: the seconds of one replica's forward and backward at the
    example batch, or the reason it could not be searched. On this machine the step is also timed:
    `seconds` is then the timed one less the fixed share every step pays (`overhead_solo_s`), and
    `predicted_s` its kernels' predicted sum."""

    seconds: float | None
    update_s: float = 0.0      # the optimizer's update on one replica (timed here, else at memory bandwidth)
    overhead_s: float = 0.0    # what a data-parallel step pays beyond a step alone, as `tfsn calibrate` measured here
    overhead_solo_s: float = 0.0   # the fixed share every step pays around its graphs (guards, wrappers, autograd)
    graphs: int = 0
    cached: bool = False
    error: str | None = None
    entries: tuple[str, ...] = ()   # the search cache entries its workers look up (shipped to cloud nodes)
    predicted_s: float | None = None   # the kernels' predicted sum where `seconds` was timed
    parallel_wait_s: float = 0.0   # a 1 ms step's wait for the other local ranks (grows as the square root)


@dataclass(frozen=True)
class EntryStep:
    """What the entry's step is: its trainable parameters, gradient bytes, the example's per-rank batch and
    dtype, and its searched step per hardware key (see planner.hardware_key)."""

    params: int
    grad_bytes: int
    example_batch: int
    dtype: str
    hardware: dict[str, HardwareStep] = field(default_factory=dict)
    seconds: float = 0.0


def _fail(spec: JobSpec, what: str, fix: str) -> PlanError:
    end = "" if what.endswith(("?", ".")) else "."      # "did you mean 'build'?" ends its own sentence
    return PlanError(f"model.entry {spec.model.entry}: {what}{end} To fix: {fix}", field=ENTRY_FIELD)


def _child_env(spec: JobSpec) -> dict[str, str]:
    """The job's `envs` (they may configure its model, as the workers see them) over this environment, and
    this tfsn's root first on PYTHONPATH (the child imports it)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **spec.envs}
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")    # the child prices, it does not train: leave the cores to others
    return env


def price_entry(spec: JobSpec, hardware: Sequence[tuple[str, int | None]], data_parallel: bool = False) -> EntryStep:
    """Import the spec's entry in a child and search its step for each (hardware key, threads); PlanError on
    `model.entry` when the user's code cannot give a step (the child's one-line reason). `data_parallel`: the
    job's workers wrap the model in DDP, whose gradient buckets split the graphs they compile (so does the child).

    A result is kept under the content of everything it depends on (the workdir's Python files, the entry,
    the hardware asked for, this tfsn's optimizer, torch's version, this CPU's calibrated spec), so planning
    the same code again starts no child at all; the child's own cache is per graph and spec."""
    from optimizer.cache import atomic_write

    key = _result_key(spec, hardware, data_parallel)
    path = _results_dir() / f"{key}.json" if key else None
    if path is not None and path.is_file():
        try:
            return _entry_step(json.loads(path.read_text()), cached=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    _check_cache()
    data = _run_child(spec, hardware, data_parallel)
    if path is not None and not any(h.get("error") for h in data["hardware"].values()):
        atomic_write(path, json.dumps(data).encode())
    return _entry_step(data)


def _check_cache() -> None:
    """PlanError unless the compile cache ($TFSN_CACHE) is a folder this user can write: the child searches into it,
    and with a file there (or a read-only folder) every search failed, said as the entry's step that "could not be
    searched: BackendCompilerFailed"."""
    from optimizer.cache import cache_dir

    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        why = None if os.access(folder, os.W_OK | os.X_OK) else "this user cannot write in it"
    except FileExistsError:
        why = "a file is there"
    except OSError as err:
        why = err.strerror or str(err)
    if why:
        raise PlanError(f"TFSN_CACHE {folder} cannot be used ({why}): model.entry's step is searched and kept there. "
                        "To fix: set TFSN_CACHE to a folder you can write to (default ~/.cache/tfsn)", field=ENTRY_FIELD)


def _entry_step(data: dict, cached: bool = False) -> EntryStep:
    return EntryStep(params=data["params"], grad_bytes=data["grad_bytes"], example_batch=data["example_batch"],
                     dtype=data["dtype"], seconds=0.0 if cached else data["seconds"],
                     hardware={name: HardwareStep(h.get("seconds"), h.get("update_s", 0.0), h.get("overhead_s", 0.0),
                                                  h.get("overhead_solo_s", 0.0), h.get("graphs", 0),
                                                  cached or h.get("cached", False), h.get("error"),
                                                  tuple(h.get("entries", ())),
                                                  h.get("predicted_s") if "timed_s" in h else None,
                                                  h.get("parallel_wait_s", 0.0))
                               for name, h in data["hardware"].items()})


def _results_dir() -> Path:
    from optimizer.cache import cache_dir
    return cache_dir() / "entry"


def _result_key(spec: JobSpec, hardware: Sequence[tuple[str, int | None]], data_parallel: bool) -> str | None:
    """The content key of a child's result, or None when the workdir is too big to hash quickly."""
    from importlib.metadata import PackageNotFoundError, version

    from optimizer.cache import content_key
    from optimizer.hardware import host_spec_path

    optimizer_dir = Path(__file__).resolve().parents[2] / "optimizer"
    parts = [spec.model.entry, json.dumps(list(hardware)), json.dumps(spec.envs, sort_keys=True), sys.executable,
             str(data_parallel)]
    try:
        parts.append(version("torch"))
    except PackageNotFoundError:
        parts.append("-")
    files = sorted(optimizer_dir.rglob("*.py"))
    host = host_spec_path()
    files += [host] if host.is_file() else []
    workdir, budget = Path(spec.workdir), [_HASHED_FILES, _HASHED_BYTES]
    for path in sorted(workdir.rglob("*.py")):
        if any(part.startswith(".") for part in path.relative_to(workdir).parts):
            continue
        budget[0] -= 1
        budget[1] -= path.stat().st_size
        if min(budget) < 0:
            return None
        files.append(path)
    try:
        parts += [f"{p}\0{p.read_bytes().hex()}" for p in files]
    except OSError:
        return None
    return content_key(*parts)


def _run_child(spec: JobSpec, hardware: Sequence[tuple[str, int | None]], data_parallel: bool) -> dict:
    file, function = spec.model.entry_parts()
    timeout = spec.model.entry_timeout
    with tempfile.TemporaryDirectory(prefix="tfsn-entry-") as folder:
        request, result = Path(folder) / "request.json", Path(folder) / "result.json"
        request.write_text(json.dumps({"workdir": spec.workdir, "file": file, "function": function,
                                       "hardware": [{"name": n, "threads": t} for n, t in hardware],
                                       "data_parallel": data_parallel}))
        with open(Path(folder) / "stderr", "w+b") as stderr:
            child = subprocess.Popen([sys.executable, "-m", "optimizer.entry", str(request), str(result)],
                                     cwd=spec.workdir, env=_child_env(spec), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
            try:
                code = child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(child)
                raise _fail(spec, f"{file} did not import, build, capture and time its step within {timeout:g} s",
                            "keep the script's training under `if __name__ == \"__main__\":`, or raise "
                            "model.entry_timeout") from None
            finally:
                _kill_group(child)    # whatever the user's code left running
            stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - _STDERR_TAIL))
            tail = stderr.read().decode(errors="replace").strip().splitlines()
        if code != 0 or not result.is_file():
            last = tail[-1] if tail else f"exit code {code}"
            raise _fail(spec, f"the child that imports {file} died: {last}", _FIX["import"])
        data = json.loads(result.read_text())
    if "error" in data:
        stage = data["error"]["stage"]
        raise _fail(spec, data["error"]["message"], _FIX.get(stage, _FIX["import"]))
    return data


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()
