"""Generated C kernels as XLA FFI handlers: custom calls that a jitted JAX function makes on the CPU.

Why: the step stays one XLA program. XLA allocates every buffer, orders the calls and runs whatever
the generator does not cover next to them, with no copy and no return to Python between kernels.
Each kernel gets a handler `tfsn_ffi_<kernel>` in the same C file: it takes the kernel's inputs
as the call's operands and its outputs as the call's results (XLA's row-major buffers, the strides
the kernel was written for, see frontends/jax.py), in the order of the kernel's parameters. The
handlers answer XLA's metadata query with the FFI API version of the headers jaxlib ships.

Threads: XLA calls a handler on one of its own worker threads, and runs independent ops and custom
calls at once on its pool of one thread per core. An OpenMP team forked from there (and MKL's,
inside a generated GEMM) competes with that pool for the same cores, and its threads spin after each
region on cores XLA has work for: the small MLP step took 0.93 ms with two-thread kernels and 0.20 ms
with one-thread kernels (XLA's own step: 0.18 ms); on larger steps more threads can pay. So a
handler runs its kernel with the `threads` OpenMP and MKL threads the library was built for (one
unless the step's race chose more, jax_backend.py; the search priced and timed them so) on the
calling thread, and puts the calling thread's settings back after.
"""
from __future__ import annotations

import ctypes
import hashlib
from typing import Sequence

from optimizer.codegen import compiler
from optimizer.codegen.c import Kernel, library_source

PRELUDE = """
#include <omp.h>
#include "xla/ffi/api/c_api.h"
typedef int (*tfsn_threads_fn)(const int*);
static tfsn_threads_fn tfsn_mkl_threads_local;     /* MKL's per-thread count (Fortran ABI): 0 puts back the global one */
static const int tfsn_global_threads = 0;
void tfsn_set_mkl_threads_local(void* fn) { tfsn_mkl_threads_local = (tfsn_threads_fn)fn; }
#define TFSN_ARG(f, i) (((XLA_FFI_Buffer*)(f)->args.args[i])->data)
#define TFSN_RET(f, i) (((XLA_FFI_Buffer*)(f)->rets.rets[i])->data)
/* XLA asks each handler, before any call, which FFI API it was built against */
static int tfsn_ffi_metadata(XLA_FFI_CallFrame* f) {
  XLA_FFI_Extension_Base* e = f->extension_start;
  if (e == NULL || e->type != XLA_FFI_Extension_Metadata) return 0;
  XLA_FFI_Metadata* m = ((XLA_FFI_Metadata_Extension*)e)->metadata;
  m->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
  m->api_version.extension_start = NULL;
  m->api_version.major_version = XLA_FFI_API_MAJOR;
  m->api_version.minor_version = XLA_FFI_API_MINOR;
  m->traits = 0;
  return 1;
}
"""


def handler_name(kernel: Kernel) -> str:
    return f"tfsn_ffi_{kernel.name}"


def operands(kernel: Kernel) -> list[int]:
    """The nodes a kernel's custom call takes as operands (what it reads and does not write), in order."""
    return [p for p in kernel.params if p not in kernel.outputs]


def handler(kernel: Kernel, threads: int) -> str:
    ins, outs = operands(kernel), list(kernel.outputs)
    args = ", ".join(f"TFSN_RET(f, {outs.index(p)})" if p in outs else f"TFSN_ARG(f, {ins.index(p)})"
                     for p in kernel.params)
    return (f"XLA_FFI_Error* {handler_name(kernel)}(XLA_FFI_CallFrame* f) {{\n"
            f"  if (tfsn_ffi_metadata(f)) return NULL;\n"
            f"  int saved = omp_get_max_threads();\n  omp_set_num_threads({threads});\n"
            f"  const int n = {threads};\n  if (tfsn_mkl_threads_local) tfsn_mkl_threads_local(&n);\n"
            f"  {kernel.name}({args});\n"
            f"  if (tfsn_mkl_threads_local) tfsn_mkl_threads_local(&tfsn_global_threads);\n  omp_set_num_threads(saved);\n"
            f"  return NULL;\n}}\n")


def ffi_source(kernels: Sequence[Kernel | None], threads: int) -> str:
    """The kernels' C file with a handler after each, running it with `threads` threads."""
    return library_source(kernels) + PRELUDE + "".join(handler(k, threads) for k in kernels if k is not None)


def register(kernels: Sequence[Kernel | None], threads: int) -> dict[str, str]:
    """Build the kernels' library and register each handler with XLA (CPU): kernel name -> the
    custom call's target name, unique to this library (two graphs each have a kernel k0)."""
    import jax.ffi

    source = ffi_source(kernels, threads)
    lib = compiler.load_library(compiler.build_library(source, [jax.ffi.include_dir()]))
    lib.tfsn_set_mkl_threads_local.argtypes = [ctypes.c_void_p]
    lib.tfsn_set_mkl_threads_local(compiler.torch_symbol("mkl_set_num_threads_local_"))
    tag = hashlib.sha256(source.encode()).hexdigest()[:16]
    targets = {}
    for k in kernels:
        if k is None:
            continue
        name = f"tfsn_{tag}_{k.name}"
        if name not in _REGISTERED:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, handler_name(k))), platform="cpu")
            _REGISTERED[name] = lib
        targets[k.name] = name
    return targets


_REGISTERED: dict[str, ctypes.CDLL] = {}     # a registered handler's library lives as long as the process
