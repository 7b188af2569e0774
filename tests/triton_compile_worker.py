"""Compiles generated Triton kernels for a GPU target in a process of its own, for
tests/test_triton_gpu_compile.py: once Triton's interpreter (TRITON_INTERPRET=1, the other Triton tests) has
run kernels in a process, triton.language stays patched there and the compiler fails on every kernel
('value' object has no attribute 'dtype').

    python tests/triton_compile_worker.py JOB.json   ->  one JSON line: {"failed": [{"name", "error"}]}
                                                         (and "ptx": {name: PTX} where JOB asks "ptx": true)

JOB: {"module": path of the kernels' module, "target": [backend, arch, warp size],
      "kernels": [{"name", "signature", "constexprs", "options"}]}
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    spec = importlib.util.spec_from_file_location(Path(job["module"]).stem, job["module"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = GPUTarget(*job["target"])
    failed, ptx = [], {}
    for k in job["kernels"]:
        fn = getattr(module, k["name"])
        # every pointer 16-byte aligned, as a launch on torch's tensors (and TritonLibrary.precompile's warmup)
        # specializes it: the variant a GPU runs (vectorized loads; a GEMM's tiles pipelined over num_stages)
        aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in k["signature"].items()
                   if kind.startswith("*")}
        try:
            compiled = triton.compile(ASTSource(fn, k["signature"], constexprs=k["constexprs"], attrs=aligned),
                                      target=target, options=k["options"])
            if job.get("ptx"):
                ptx[k["name"]] = compiled.asm["ptx"]
        except Exception as err:  # noqa: BLE001 - any refusal of Triton's compiler is the finding
            failed.append({"name": k["name"], "error": f"{type(err).__name__}: {str(err)[:2000]}"})
    print(json.dumps({"failed": failed} | ({"ptx": ptx} if job.get("ptx") else {})))


if __name__ == "__main__":
    main(sys.argv[1])
