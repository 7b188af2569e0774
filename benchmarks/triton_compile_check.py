"""Every Triton kernel tfsn writes for the user-model suites, compiled for an H100 (sm_90) on this CPU.

Why: Triton's interpreter (the tests' way to run the kernels here) runs their values but not Triton's
compiler, which refused on a GPU what the interpreter ran (a literal out of an int8's range, on an H200).
tests/test_triton_gpu_compile.py compiles the suite's kernels in CI; this compiles those of every model of
tests/user_models*.py, forward, backward and an AdamW (foreach) step, under the heuristic plan or the H100
model's plan (`--plan h100`), too many for CI (about 1700 kernels a plan, 11 minutes here).

The models run through torch.compile with the Triton target under TRITON_INTERPRET=1, with each graph's
kernels recorded where the backend would compile them ahead (TritonLibrary.precompile) and launches
replaced by zero-filling their outputs (the values do not matter, only the kernels written), then compiled
in a process without the interpreter (tests/triton_compile_worker.py).

    python benchmarks/triton_compile_check.py [--plan default|h100] [--suites user_models,user_models_more,user_models_third] [--json]
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported
os.environ.setdefault("TFSN_TOP_K", "1")  # the H100 model's picks, untimed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from optimizer import backend  # noqa: E402
from optimizer.backend import make_backend  # noqa: E402
from optimizer.codegen import triton as tt  # noqa: E402
from optimizer.hardware import find_hardware  # noqa: E402
from tests.test_triton_gpu_compile import POINTERS, WORKER  # noqa: E402

JOBS: dict[str, dict[tuple, dict]] = {}      # module path -> distinct launches to compile


def record(library: tt.TritonLibrary, graph, kernels) -> list:
    """TritonLibrary.precompile's stand-in: each launch of each kernel, as the worker compiles it."""
    for k in kernels:
        if k is None or (k.product is not None and not k.product.epilogue):
            continue
        dtypes = k.pointer_dtypes(graph)
        names = [f"p{i}" for i in range(len(k.params))] + (["prod"] if k.product is not None else [])
        names += [f"s{j}" for j in range(len(dtypes) - len(names))]
        for name, _, launch in k.launches():
            signature = {n: POINTERS[str(d).removeprefix("torch.")] for n, d in zip(names, dtypes)}
            meta = dict(launch)
            options = {n: meta.pop(n) for n in ("num_warps", "num_stages") if n in meta}
            signature.update({n: "constexpr" for n in meta})
            key = (name, tuple(signature.items()), tuple(meta.items()), tuple(options.items()))
            JOBS.setdefault(str(library.path), {})[key] = {"name": name, "signature": signature, "constexprs": meta,
                                                           "options": options}
    return []


def zero_filled(library: tt.TritonLibrary, kernel: tt.TritonKernel):
    """TritonLibrary.launcher's stand-in: a library product runs; a kernel's outputs are zeros."""
    if kernel.product is not None and not kernel.product.epilogue:
        return kernel.product.run
    outputs = [kernel.params.index(o) for o in kernel.outputs if o in kernel.params]

    def launch(tensors) -> None:
        for i in outputs:
            tensors[i].zero_()
    return launch


def trace(suites: list[str]) -> list[tuple[str, str]]:
    """Each model's step compiled (and so its kernels recorded); the models that failed, with why."""
    failed = []
    for suite in suites:
        for case in importlib.import_module(f"tests.{suite}").cases():
            torch._dynamo.reset()
            try:
                torch.manual_seed(0)
                model = case.build()
                inputs, target = case.batch(torch.Generator().manual_seed(0))
                out, loss = case.step(torch.compile(model, backend=make_backend(codegen="triton")), inputs, target)
                loss.backward()
                step = torch.optim.AdamW([p for p in model.parameters() if p.grad is not None], foreach=True).step
                torch.compile(step, backend=make_backend(codegen="triton"))()
            except Exception as e:  # noqa: BLE001 - a model that fails to trace is reported, the rest go on
                failed.append((case.name, f"{type(e).__name__}: {str(e)[:300]}"))
    return failed


def compile_all() -> tuple[int, list[dict]]:
    """The recorded launches compiled for sm_90, module by module: how many, and the failures."""
    total, failures = 0, []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    folder = Path(tempfile.mkdtemp(prefix="tfsn-compile-check-"))
    for n, (path, jobs) in enumerate(JOBS.items()):
        job = folder / f"{n}.json"
        job.write_text(json.dumps({"module": path, "target": ["cuda", 90, 32], "kernels": list(jobs.values())}))
        run = subprocess.run([sys.executable, str(WORKER), str(job)], capture_output=True, text=True, env=env,
                             timeout=1800)
        total += len(jobs)
        if run.returncode != 0:
            failures.append({"module": path, "name": "(worker)", "error": run.stderr[-2000:]})
            continue
        failures += [{"module": path, **f} for f in json.loads(run.stdout.strip().splitlines()[-1])["failed"]]
    return total, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", choices=("default", "h100"), default="default",
                        help="the heuristic plan, or the H100 cost model's (what runs on an H100)")
    parser.add_argument("--suites", default="user_models,user_models_more,user_models_third")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tt.TritonLibrary.precompile = record
    tt.TritonLibrary.launcher = zero_filled
    if args.plan == "h100":
        spec = find_hardware("h100")
        backend.gpu_spec = lambda device: spec
    untraced = trace(args.suites.split(","))
    total, failures = compile_all()
    print(f"{args.plan} plan: {total} kernels in {len(JOBS)} modules compiled for sm_90, {len(failures)} failed; "
          f"{len(untraced)} models not traced")
    for f in failures:
        print(f"FAILED {f['name']} ({f['module']}): {f['error'][:1500]}")
    for name, why in untraced:
        print(f"NOT TRACED {name}: {why}")
    if args.json:
        print(json.dumps({"plan": args.plan, "kernels": total, "modules": len(JOBS), "failed": len(failures),
                          "untraced": len(untraced)}))


if __name__ == "__main__":
    main()
