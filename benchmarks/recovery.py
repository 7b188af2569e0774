"""Seconds from a worker's `kill -9` to training again, the steps redone, and the stall of a checkpoint,
on the real local stack.

    python benchmarks/recovery.py [--json] [--repeats 3] [--steps 200] [--interval 25] [--kill-after 12]
                                  [--stall-steps 120] [--stall-interval 10] [--stall-repeats 2] [--spares 0]

Each repeat launches examples/tiny-gpt (its default model, 2 nodes x 1 worker on the local provider)
with `python tfsn.py launch <spec> --detach` in a fresh TFSN_HOME, waits until a checkpoint exists and
rank 0 reported `--kill-after` steps past it, SIGKILLs rank 1's worker and waits for SUCCEEDED. The
store's events and rank 0's step records then time each phase, in seconds after the kill:
  noticed          the controller saw the failure (first 'attempt ... failed' or 'node ... failed' event)
  recovering       the job went RECOVERING
  node ready       the replacement node's agent reported ready, or a ready spare took the rank
  running          attempt 2 started (RUNNING)
  workers started  the later of attempt 2's two worker processes started (the kernel's start time)
  step start       the first step of attempt 2 began (its record's time minus its step time)
  step done        that step completed
and steps redone = last step completed in attempt 1 + 1 - first step of attempt 2. The restart breakdown
splits that time: detection (kill to noticed), provisioning (noticed to the new node's agent ready),
process start (to the later worker started), restore (to the first step's start: imports, init, restore).

Checkpoint stall: the example runs `--stall-steps` steps without a kill, saving every `--stall-interval`,
once with synchronous saves and once asynchronous (checkpoint.async_save), side by side. The SDK logs the
seconds each saving step spent in `run.checkpoint` (the training thread's stall: for an async save the copy
to memory, plus any wait for the previous save) as its `checkpoint_stall_s` metric; the table gives their
median over saves, the median step without a save, the ratio, and the median step right after a save
(where an async save's background write competes for the CPU).
Why: recovering from a dead node with little lost work is what tfsn's "heal" promises; the phases
show where the time goes. Figures are medians over repeats (the machine is shared and noisy).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import yaml

# This folder holds health.py, which would shadow the `health` package: the repo root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import print_table
from orchestrator.control import daemon
from orchestrator.control.store import Event, Job, JobState, NodeState, Store
from providers.local import tagged_pids

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-gpt"
BREAKDOWN = ("detection", "provisioning", "process start", "restore")
PHASES: dict[str, Callable[[Event], bool]] = {
    "noticed": lambda e: e.kind in ("attempt", "node") and " failed: " in e.message,
    "recovering": lambda e: e.kind == "state" and e.message.startswith("RECOVERING"),
    # a new node's agent ready for the rank, or a ready spare taking it (no provisioning at all)
    "node ready": lambda e: e.kind == "node" and (" ready (rank " in e.message or " takes rank " in e.message),
    "running": lambda e: e.kind == "state" and e.message.startswith("RUNNING"),
}


def write_spec(path: Path, name: str, steps: int, interval: int, async_save: bool = True, spares: int = 0,
               straggler: str | None = None) -> Path:
    """The example's train.yaml with its workdir pointing at the example, like tests/conftest.py:write_job.
    `straggler` overrides the health action on stragglers (the stall runs only warn: on a shared machine
    a noisy node replaced mid-run would cut their sample short)."""
    spec = yaml.safe_load((EXAMPLE / "train.yaml").read_text())
    spec.update(name=name, workdir=str(EXAMPLE), steps=steps,
                checkpoint={"interval": interval, "keep": 3, "dir": str(path.parent / f"{name}-ckpt"),
                            "async_save": async_save})
    spec["recovery"] = {**spec.get("recovery", {}), "spares": spares}
    if straggler is not None:
        spec["health"] = {"actions": {"straggler": straggler}}
    path.write_text(yaml.safe_dump(spec))
    return path


def job_log_tail(home: Path, job_id: int) -> str:
    log = home / "jobs" / str(job_id) / "job.log"
    return log.read_text(errors="replace")[-3000:] if log.exists() else "(no job log)"


def wait_for(store: Store, home: Path, job_id: int, until: Callable[[Job], bool], what: str,
             poll: Callable[[Job], None] = lambda job: None, timeout: float = 300.0) -> Job:
    """The job once `until(job)` holds, calling `poll(job)` every 0.1 s meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        job = store.job(job_id)
        if until(job):
            return job
        poll(job)
        if job.state.terminal or time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} is {job.state.value} while waiting for {what} {job.error}\n"
                               + job_log_tail(home, job_id))
        time.sleep(0.1)


def workers(node_id: str, **env: str) -> dict[int, float]:
    """Training processes of local node `node_id` whose environment holds every KEY=VALUE in `env`
    (found as tests/test_e2e.py finds them), each with the time.time() it started."""
    wanted = {f"{k}={v}".encode() for k, v in env.items()}
    found = {}
    for pid in tagged_pids(node_id):
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
            uptime = float(Path("/proc/uptime").read_text().split()[0])
        except OSError:
            continue
        if wanted <= environ and b"train.py" in cmdline:
            found[pid] = time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def launch(store: Store, env: dict[str, str], spec: Path) -> int:
    """`tfsn launch SPEC --detach`; the job's id."""
    done = subprocess.run([sys.executable, str(ROOT / "tfsn.py"), "launch", str(spec), "--detach"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"tfsn launch exited {done.returncode}: {done.stderr}")
    return store.find_job(yaml.safe_load(spec.read_text())["name"]).id


def one_stall_run(store: Store, home: Path, env: dict[str, str], spec: Path) -> dict[str, list[float]]:
    """Launch with no kill, wait for SUCCEEDED; rank 0's stalls and step times (plain, and right after a save)."""
    job_id = launch(store, env, spec)
    job = wait_for(store, home, job_id, lambda j: j.state.terminal, "the job to end", timeout=900)
    if job.state != JobState.SUCCEEDED:
        raise RuntimeError(f"job {job_id} ended {job.state.value}: {job.error}\n" + job_log_tail(home, job_id))
    records = store.steps(job_id, attempt=1)[5:]   # the first steps warm up
    saving = [i for i, r in enumerate(records) if "checkpoint_stall_s" in r["metrics"]]
    plain = [r["step_time"] for i, r in enumerate(records) if i not in saving and i - 1 not in saving]
    if not saving or not plain:
        raise RuntimeError(f"job {job_id}: {len(saving)} saving and {len(plain)} plain steps reported")
    return {"stall": [records[i]["metrics"]["checkpoint_stall_s"] for i in saving], "step": plain,
            "wait": [records[i]["metrics"].get("checkpoint_wait_s", 0.0) for i in saving],
            "after": [records[i + 1]["step_time"] for i in saving if i + 1 < len(records)]}


def stall_figures(samples: list[dict[str, list[float]]]) -> dict[str, float]:
    """Medians over every save and step of a mode's runs, in milliseconds, and the stall as a share of a step."""
    stall, step, after, wait = ([x for s in samples for x in s[key]] for key in ("stall", "step", "after", "wait"))
    return {"saves": len(stall), "stall ms": statistics.median(stall) * 1000, "step ms": statistics.median(step) * 1000,
            "wait ms": statistics.median(wait) * 1000,
            "stall / step": statistics.median(stall) / statistics.median(step),
            "step after save ms": statistics.median(after) * 1000 if after else float("nan")}


def one_recovery(store: Store, home: Path, env: dict[str, str], spec: Path, kill_after: int) -> dict[str, float]:
    """Launch, kill rank 1's worker past a checkpoint, wait for SUCCEEDED; the phases in seconds after the kill."""
    job_id = launch(store, env, spec)
    wait_for(store, home, job_id, lambda j: j.checkpoint_step is not None and j.attempt == 1
             and j.step + 1 - j.checkpoint_step >= kill_after, f"a checkpoint and {kill_after} steps past it")
    node = next(n for n in store.nodes(job_id) if n.rank == 1 and n.state == NodeState.READY)
    victim = list(workers(node.id, RANK="1"))
    if len(victim) != 1:
        raise RuntimeError(f"expected one worker of rank 1 on node {node.id}, found {victim}")
    killed_at = time.time()
    os.kill(victim[0], signal.SIGKILL)
    started: dict[int, float] = {}  # attempt 2's workers and when they started

    def watch(job: Job) -> None:
        if job.attempt == 2 and len(started) < job.spec["num_nodes"]:
            for n in store.nodes(job_id, active_only=True):
                started.update(workers(n.id, RANK=str(n.rank), TFSN_ATTEMPT="2"))

    job = wait_for(store, home, job_id, lambda j: j.state.terminal, "the job to end", poll=watch)
    if job.state != JobState.SUCCEEDED or job.restarts != 1 or len(started) != job.spec["num_nodes"]:
        raise RuntimeError(f"job {job_id} ended {job.state.value} after {job.restarts} restart(s), "
                           f"{len(started)} worker(s) of attempt 2 seen: {job.error}\n" + job_log_tail(home, job_id))
    events = [e for e in store.events(job_id) if e.at >= killed_at]
    figures = {}
    for name, matches in PHASES.items():
        event = next((e for e in events if matches(e)), None)
        if event is None:
            raise RuntimeError(f"job {job_id}: no '{name}' event after the kill\n" + job_log_tail(home, job_id))
        figures[name] = event.at - killed_at
    figures["workers started"] = max(started.values()) - killed_at
    first = store.steps(job_id, attempt=2)[0]
    figures["step start"] = first["at"] - first["step_time"] - killed_at
    figures["step done"] = first["at"] - killed_at
    before = store.steps(job_id, attempt=1)
    figures["steps redone"] = max(r["step"] for r in before) + 1 - first["step"]
    figures["step ms"] = statistics.median(r["step_time"] for r in before) * 1000
    figures["restored from"] = first["step"]
    figures["detection"] = figures["noticed"]
    figures["provisioning"] = figures["node ready"] - figures["noticed"]
    figures["process start"] = figures["workers started"] - figures["node ready"]
    figures["restore"] = figures["step start"] - figures["workers started"]
    return figures


def shut_down(store: Store, home: Path) -> list[int]:
    """Stop unfinished jobs and the controller; kill (and return) any process of our nodes still alive."""
    for job in store.jobs(active_only=True):
        store.request_stop(job.id)
    info = daemon.read_info(home)
    if info is not None:
        deadline = time.monotonic() + 60
        while store.jobs(active_only=True) and time.monotonic() < deadline:
            time.sleep(0.2)
        daemon.stop_controller(home)
        deadline = time.monotonic() + 30
        while alive(info["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
    leftovers = [pid for job in store.jobs() for node in store.nodes(job.id) for pid in tagged_pids(node.id)]
    if info is not None and alive(info["pid"]):
        leftovers.append(info["pid"])
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return leftovers


def print_restarts(args: argparse.Namespace, runs: list[dict[str, float]]) -> dict[str, float]:
    """The kill runs' tables; their medians."""
    medians = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    print(f"{args.repeats} repeat(s), {args.steps} steps, {args.spares} spare(s), checkpoint every {args.interval}, "
          f"kill of rank 1 {args.kill_after}+ steps past a checkpoint")

    def row(name: str) -> list[str]:
        return [name, f"{medians[name]:.2f}", f"{min(r[name] for r in runs):.2f}", f"{max(r[name] for r in runs):.2f}"]

    print_table(["seconds after kill -9", "median", "min", "max"],
                [row(name) for name in [*PHASES, "workers started", "step start", "step done"]])
    print("\nrestart breakdown:")
    print_table(["phase", "median s", "min", "max"], [row(name) for name in BREAKDOWN])
    print(f"steps redone: median {medians['steps redone']:g} (each: {', '.join(str(r['steps redone']) for r in runs)});"
          f" attempt 2 restarted from step {', '.join(str(r['restored from']) for r in runs)};"
          f" median step before the kill {medians['step ms']:.0f} ms")
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="jobs launched and killed (default 3; 0: none)")
    parser.add_argument("--steps", type=int, default=200, help="training steps of each job (default 200)")
    parser.add_argument("--interval", type=int, default=25, help="checkpoint interval in steps (default 25)")
    parser.add_argument("--kill-after", type=int, default=12, help="steps past a checkpoint, as rank 0 reported "
                        "them, before the kill (default 12; the report lags up to a second behind)")
    parser.add_argument("--spares", type=int, default=0, help="recovery.spares of the killed jobs: a ready spare "
                        "takes the failed rank with no provisioning (default 0)")
    parser.add_argument("--stall-steps", type=int, default=120, help="steps of each stall run (default 120)")
    parser.add_argument("--stall-interval", type=int, default=10, help="checkpoint interval of the stall runs "
                        "(default 10)")
    parser.add_argument("--stall-repeats", type=int, default=2, help="rounds of a sync and an async stall run "
                        "(default 2)")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    args = parser.parse_args()
    counts = (args.repeats, args.steps, args.interval, args.kill_after, args.stall_steps, args.stall_interval,
              args.stall_repeats)
    if min(args.spares, args.repeats) < 0 or min(counts[1:]) < 1:
        parser.error("every option must be >= 1 (--spares and --repeats >= 0)")

    began = time.monotonic()
    runs: list[dict[str, float]] = []
    stalls: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tfsn-recovery-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("TFSN_")},
               "TFSN_HOME": str(home), "TFSN_CONTROLLER_IDLE_S": "60"}
        store = Store(daemon.store_path(home))
        try:
            samples: dict[str, list[dict[str, list[float]]]] = {"sync": [], "async": []}
            for round_ in range(args.stall_repeats):   # alternated, so that a change of load hits both modes
                for mode in samples:
                    spec = write_spec(Path(tmp) / f"stall-{mode}-{round_}.yaml", f"stall-{mode}-{round_}",
                                      args.stall_steps, args.stall_interval, async_save=mode == "async",
                                      straggler="warn")
                    samples[mode].append(one_stall_run(store, home, env, spec))
                    print(f"{mode} saves, round {round_ + 1}: median stall "
                          f"{statistics.median(samples[mode][-1]['stall']) * 1000:.1f} ms per save", flush=True)
            stalls.update({mode: stall_figures(runs_of_mode) for mode, runs_of_mode in samples.items()})
            for i in range(args.repeats):
                spec = write_spec(Path(tmp) / f"bench-{i}.yaml", f"bench-{i}", args.steps, args.interval,
                                  spares=args.spares)
                runs.append(one_recovery(store, home, env, spec, args.kill_after))
                print(f"repeat {i + 1}/{args.repeats}: first step of attempt 2 done "
                      f"{runs[-1]['step done']:.1f}s after the kill", flush=True)
        finally:
            leftovers = shut_down(store, home)
            store.close()
    if leftovers:
        print(f"error: processes were left behind and killed: {leftovers}", file=sys.stderr)

    print(f"\n{time.monotonic() - began:.0f}s in all")
    medians = print_restarts(args, runs) if runs else {}
    print(f"\ncheckpoint stall, {args.stall_repeats} x {args.stall_steps} steps per mode, a save every "
          f"{args.stall_interval} (rank 0, medians over saves and steps):")
    print_table(["saves", "per save ms", "of it waiting ms", "step ms", "stall / step", "step after save ms"],
                [[f"{mode} ({s['saves']:g})", f"{s['stall ms']:.1f}", f"{s['wait ms']:.1f}", f"{s['step ms']:.1f}",
                  f"{s['stall / step']:.1%}", f"{s['step after save ms']:.1f}"] for mode, s in stalls.items()])
    print(f"async / sync stall per save: {stalls['async']['stall ms'] / stalls['sync']['stall ms']:.3f}")
    if args.json:
        print(json.dumps({"benchmark": "recovery", "repeats": args.repeats, "steps": args.steps,
                          "interval": args.interval, "kill_after": args.kill_after, "spares": args.spares,
                          "median": medians,
                          "runs": runs, "stall": stalls, "stall_steps": args.stall_steps,
                          "stall_interval": args.stall_interval,
                          "stall_repeats": args.stall_repeats, "leftover_processes": leftovers}))
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
