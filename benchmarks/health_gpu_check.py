"""On a machine with an NVIDIA GPU: the per-rank compute signal and NVML sampling, on the real device.

    bash benchmarks/health_gpu_check.sh [--steps 40] [--busy-ms 30] [--json]

1. Two DDP ranks train the same small MLP; rank 1 is slowed by a busy kernel (torch.cuda._sleep) of
   `--busy-ms` in every step, before its backward pass. Each rank's compute time is measured two ways:
   on the device timeline with CUDA events (orchestrator/sdk/commtimer.py: step start to the last
   gradient bucket ready), and on the CPU (the step less the exposed all-reduce wait, the gloo path).
   With two GPUs or more the ranks use NCCL, one GPU each: there the CPU path reads a wait of ~0 and
   cannot tell the ranks apart, the device path must. With one GPU, NCCL refuses two ranks on one
   device, so both ranks share it over gloo (CUDA tensors); the GPU time-slices between the two
   processes, so the fast rank's device time also stretches a little.
   Pass: the slow rank's median device compute exceeds the fast rank's by at least half the busy time.
2. NVML through health/telemetry.py's NvmlSource: every GPU's clocks, throttle reasons, temperature,
   power, ECC and Xid registration, idle and then under a matrix-product load.
   Pass: every GPU reads a clock ratio in (0, 1.05] and a temperature and power in range.
Why: the straggler signal and the device telemetry were only ever tested without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from orchestrator.sdk import commtimer  # noqa: E402


def spin_cycles(ms: float) -> int:
    """Cycles of torch.cuda._sleep that spin the device for `ms` milliseconds (measured once, warm)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(ms * 10_000_000 / start.elapsed_time(end))


def rank_main(rank: int, store: str, out: str, steps: int, busy_ms: float) -> None:
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    device = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(2048, 2048, device=device) for _ in range(6)]
        on_device = DistributedDataParallel(torch.nn.Sequential(*layers), device_ids=[device.index])
        device_timer = commtimer.install(on_device)                  # CUDA events: the device path
        torch.manual_seed(0)
        on_cpu = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, device=device)
                                                               for _ in range(6)]), device_ids=[device.index])
        cpu_timer = commtimer.CommTimer()                             # the CPU path, forced
        on_cpu.register_comm_hook(None, cpu_timer.hook)
        cycles = spin_cycles(busy_ms)
        x = torch.randn(256, 2048, device=device)
        found: dict[str, list[float]] = {"device": [], "cpu": []}
        for model, timer, name in ((on_device, device_timer, "device"), (on_cpu, cpu_timer, "cpu")):
            for step in range(steps):
                timer.step_started()
                began = time.perf_counter()
                loss = model(x).square().mean()
                if rank == 1:
                    torch.cuda._sleep(cycles)                          # the injected busy kernel
                loss.backward()
                torch.cuda.synchronize()                               # the step ends as a training step would
                value = timer.take_compute(time.perf_counter() - began)
                value = value.resolve() if isinstance(value, commtimer.PendingCompute) else value
                if step >= 5 and value is not None:
                    found[name].append(value)
        Path(out).write_text(json.dumps({"backend": backend, **found}))
    finally:
        dist.destroy_process_group()


def _entry(rank: int, store: str, folder: str, steps: int, busy_ms: float) -> None:
    rank_main(rank, store, str(Path(folder) / f"rank{rank}.json"), steps, busy_ms)


def per_rank_signal(steps: int, busy_ms: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_entry, args=(str(Path(folder) / "store"), folder, steps, busy_ms), nprocs=2,
                           start_method="spawn")
        fast, slow = (json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(2))
    med = {f"{name}_{r}_ms": 1e3 * statistics.median(d[name]) for r, d in ((0, fast), (1, slow))
           for name in ("device", "cpu")}
    gap = med["device_1_ms"] - med["device_0_ms"]
    return {"backend": fast["backend"], "busy_ms": busy_ms, **med, "device_gap_ms": gap,
            "cpu_gap_ms": med["cpu_1_ms"] - med["cpu_0_ms"], "pass": gap >= 0.5 * busy_ms}


def nvml_samples() -> dict:
    from health.telemetry import NvmlSource
    source = NvmlSource("gpu-check")
    try:
        idle = [s for s in source.sample() if s.xid is None]
        stop = threading.Event()

        def load() -> None:
            a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            while not stop.is_set():
                a @ a
                torch.cuda.synchronize()

        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        time.sleep(3.0)
        busy = [s for s in source.sample() if s.xid is None]
        stop.set()
        worker.join()
        rows = [{"when": when, "gpu": s.gpu, "sm_mhz": s.sm_clock_mhz, "max_sm_mhz": s.max_sm_clock_mhz,
                 "ratio": s.clock_ratio, "reasons": s.clock_event_reasons, "temp_c": s.temperature_c,
                 "power_w": s.power_w, "ecc_sbe": s.ecc_sbe_volatile, "ecc_dbe": s.ecc_dbe_volatile,
                 "xid_watched": s.xid_watched is not False}
                for when, samples in (("idle", idle), ("load", busy)) for s in samples]
        ok = bool(rows) and all(r["ratio"] is not None and 0 < r["ratio"] <= 1.05 and 0 < (r["temp_c"] or 0) < 120
                                and 0 < (r["power_w"] or 0) < 2000 for r in rows)
        return {"samples": rows, "unwatched": source.unwatched, "pass": ok}
    finally:
        source.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--busy-ms", type=float, default=30.0)
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device here: run this on a machine with an NVIDIA GPU")
        return 2
    signal = per_rank_signal(args.steps, args.busy_ms)
    print(f"per-rank compute ({signal['backend']}, rank 1 slowed by a {args.busy_ms:g} ms busy kernel), medians:")
    print(f"  device (CUDA events): rank 0 {signal['device_0_ms']:.1f} ms, rank 1 {signal['device_1_ms']:.1f} ms, "
          f"gap {signal['device_gap_ms']:.1f} ms -> {'PASS' if signal['pass'] else 'FAIL'}")
    print(f"  cpu (step - exposed wait): rank 0 {signal['cpu_0_ms']:.1f} ms, rank 1 {signal['cpu_1_ms']:.1f} ms, "
          f"gap {signal['cpu_gap_ms']:.1f} ms")
    nvml = nvml_samples()
    print(f"NVML: {len(nvml['samples'])} samples, unwatched Xid registrations {nvml['unwatched'] or 'none'} -> "
          f"{'PASS' if nvml['pass'] else 'FAIL'}")
    for row in nvml["samples"]:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    report = {"signal": signal, "nvml": nvml}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "health_gpu_check.json").write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
    return 0 if signal["pass"] and nvml["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
