"""C source to a loaded shared object: gcc with flags for this host, through the compile cache.

The generated code links no OpenMP runtime of its own choosing: `-fopenmp` names libgomp.so.1,
and torch has already loaded its libgomp.so.1 into the process, so the loader reuses it (one
thread pool, torch.set_num_threads applies to our kernels too).
"""
from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from pathlib import Path
from typing import Sequence

from optimizer.cache import atomic_write, content_key, get_or_build

COMPILE_TIMEOUT_S = 300


class CompileError(RuntimeError):
    """gcc rejected generated code: a bug in the generator, never the user's."""


@functools.lru_cache(maxsize=None)
def compiler_id() -> str:
    cc = os.environ.get("CC", "gcc")
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.splitlines()[0]


@functools.lru_cache(maxsize=None)
def missing_compiler() -> str | None:
    """Why no C compiler can build generated kernels here (none named `$CC`, default gcc, runs), or None. Asked
    once per process, as compiler_id is: that caches a compiler that runs, not one that fails, and each graph of a
    step asks."""
    try:
        compiler_id()
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        return f"the C compiler {os.environ.get('CC', 'gcc')!r} does not run ({type(e).__name__}: {e})"
    return None


@functools.lru_cache(maxsize=None)
def hardware_id() -> str:
    """The CPU model and its feature flags: what -march=native compiles for."""
    from optimizer.hardware import cpuinfo
    return f"{cpuinfo('model name')}|{cpuinfo('flags')}"


@functools.lru_cache(maxsize=None)
def host_flags() -> tuple[str, ...]:
    """-march=native for this CPU's SIMD; libmvec (vector exp/log/tanh/erf) when glibc has it."""
    flags = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=gnu11",
             "-fno-math-errno", "-fno-trapping-math", "-fno-semantic-interposition",
             "-fwrapv",   # integers wrap on overflow, as torch's do (signed overflow is undefined in C)
             # gcc 12 at -O3 with AVX-512 computed wrong values in a BatchNorm backward whose ReLU mask
             # selects a load made in one arm (an if-converted masked load): at -O0, for AVX2, or
             # without ivopts (or loop-invariant motion) it computes eager's. No loss measured without
             # ivopts on the benchmark (tests/test_optimizer_codegen.py, strided residual block).
             "-fno-ivopts"]
    if any(Path(d, "libmvec.so").exists() for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
                                                    "/usr/lib64", "/lib64")):
        return tuple(flags + ["-DTFSN_LIBMVEC", "-lmvec", "-lm"])
    return tuple(flags + ["-lm"])


def build_library(source: str, include_dirs: Sequence[str] = ()) -> Path:
    """The shared object for `source`, compiled once per (source, compiler, flags, hardware);
    `include_dirs`: headers it includes beyond libc's (XLA's FFI API, codegen/xla_ffi.py)."""
    includes = [f"-I{d}" for d in include_dirs]
    key = content_key(source, compiler_id(), " ".join([*host_flags(), *includes]), hardware_id())

    def compile_to(out: Path) -> None:
        cc = os.environ.get("CC", "gcc")
        flags = host_flags()
        cmd = [cc, *[f for f in flags if not f.startswith("-l")], *includes, "-x", "c", "-", "-o", str(out),
               *[f for f in flags if f.startswith("-l")]]
        proc = subprocess.run(cmd, input=source, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise CompileError(f"gcc failed on generated code:\n{proc.stderr[-4000:]}")

    path = get_or_build(key, ".so", compile_to)
    if not path.with_suffix(".c").exists():        # beside the artifact, for people to read
        atomic_write(path.with_suffix(".c"), source.encode())
    return path


@functools.lru_cache(maxsize=None)
def torch_symbol(name: str) -> int | None:
    """The address of a C symbol of torch's CPU library (its BLAS: MKL here), or None on a build without it."""
    import torch
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def sgemm_address() -> int | None:
    """torch's own BLAS sgemm (Fortran ABI, 32-bit ints), or None on a build without one."""
    return torch_symbol("sgemm_")


def load_library(path: Path) -> ctypes.CDLL:
    """Load a generated library and hand it the BLAS sgemm that torch itself uses (MKL here)."""
    lib = ctypes.CDLL(str(path))
    lib.tfsn_set_sgemm.argtypes = [ctypes.c_void_p]
    lib.tfsn_set_sgemm(sgemm_address())
    return lib
