"""What the CLI shows of a job: the live view of `tfsn launch`, and `tfsn status`."""
from __future__ import annotations

import codecs
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from orchestrator.control.cost import JobCost, job_cost
from orchestrator.control.store import Job, JobState, Node, Store
from orchestrator.planning.offers import offer_path, offer_text

_STATE_STYLE = {JobState.SUCCEEDED: "green", JobState.FAILED: "red", JobState.STOPPED: "yellow",
                JobState.RECOVERING: "magenta", JobState.RUNNING: "cyan"}


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


def progress(job: Job) -> dict[str, Any]:
    """The figures a user watches: step, loss, step time, throughput, ETA."""
    total = job.spec.get("steps")
    done = max(job.step + 1 if job.step_time is not None else 0, job.restored_step or 0)
    eta = (total - done) * job.step_time if total and job.step_time else None
    return {"step": done, "total_steps": total, "loss": job.loss, "step_time_s": job.step_time,
            "steps_per_s": 1 / job.step_time if job.step_time else None, "eta_s": eta}


def job_summary(store: Store, job: Job) -> dict[str, Any]:
    """Everything `tfsn status JOB --json` prints."""
    end = job.finished_at or time.time()
    nodes = store.nodes(job.id)
    return {
        "id": job.id, "name": job.name, "state": job.state.value, "spec_path": job.spec_path,
        "num_nodes": job.spec.get("num_nodes"), "attempt": job.attempt, "restarts": job.restarts,
        **progress(job), "restored_step": job.restored_step,
        "checkpoint": {"step": job.checkpoint_step, "path": job.checkpoint_path} if job.checkpoint_step else None,
        "error": job.error or None, "created_at": job.created_at, "finished_at": job.finished_at,
        "duration_s": end - job.created_at,
        "cost": job_cost(job, nodes).to_dict(),
        "nodes": [{"id": n.id, "rank": n.rank, "provider": n.provider,
                   "where": offer_path(n.offer) if n.offer else n.provider, "spot": n.spot,
                   "state": n.state.value,
                   "heartbeat_age_s": None if n.heartbeat_at is None else time.time() - n.heartbeat_at,
                   "failure": n.failure or None, "boot_log": n.boot_failure or None} for n in nodes],
        # the planner's best candidates (what failover walks down; their search entries are the nodes' business) and
        # what provisioning errors ruled out
        "plan": [{k: v for k, v in c.items() if k not in ("offer", "search_entries")} for c in job.plan[:5]],
        "blocked": [{"provider": b["offer"]["provider"], "region": b["offer"]["region"], "zone": b["offer"]["zone"],
                     "instance_type": b["offer"]["instance_type"], "scope": b["scope"], "error": b["error"]}
                    for b in job.blocked],
        "events": [{"at": e.at, "kind": e.kind, "message": e.message} for e in store.events(job.id)][-50:],
    }


def boot_failures(store: Store, job: Job, lines: int = 20) -> list[str]:
    """The end of the boot log of each node whose boot failed (what its VM sent before it powered off)."""
    shown = []
    for node in store.nodes(job.id):
        if node.boot_failure:
            shown.append(f"node {node.id} failed to boot; the end of its boot log:")
            shown += [f"    {line}" for line in node.boot_failure.splitlines()[-lines:]]
    return shown


def _where(node: Node) -> str:
    """Where a node runs, as far as the plan said."""
    return offer_text(node.offer, node.spot) if node.offer else node.provider


def aligned(rows: list[tuple[str, ...]], left: int | None = None) -> list[str]:
    """Rows as plain aligned text (a table of hundreds of rows must not be squeezed to the terminal's width):
    the first `left` columns (all by default) flush left, the others flush right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    left = len(widths) if left is None else left
    return ["  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            .rstrip() for row in rows]


def _dollars(value: float | None) -> str:
    return "-" if value is None else f"${value:,.2f}"


def cost_text(cost: JobCost, spec: dict) -> str:
    """`1.50 node-h, $3.00 spent of $10.00 predicted (8.00 node-h)`; a job without `model:` says why it has no
    prediction."""
    text = f"{cost.node_hours:,.2f} node-h, {_dollars(cost.spent_usd)} spent"
    if cost.predicted_usd is not None:
        text += f" of {_dollars(cost.predicted_usd)} predicted ({cost.predicted_node_hours:,.2f} node-h)"
    elif spec.get("model") is None:
        text += " (no prediction: the spec has no model:)"
    return text


def jobs_table(store: Store, jobs: list[Job]) -> Table:
    table = Table(box=None, header_style="bold", padding=(0, 1, 0, 0))   # eleven columns in 80 characters
    for column in ("ID", "NAME", "STATE", "NODES", "STEP", "LOSS", "RESTARTS", "AGE", "NODE-H", "SPENT", "PREDICTED"):
        table.add_column(column, justify="right" if column in ("NODE-H", "SPENT", "PREDICTED") else "left")
    for job in jobs:
        p = progress(job)
        cost = job_cost(job, store.nodes(job.id))
        step = f"{p['step']}/{p['total_steps']}" if p["total_steps"] else str(p["step"])
        table.add_row(str(job.id), job.name, Text(job.state.value, style=_STATE_STYLE.get(job.state, "")),
                      str(job.spec.get("num_nodes")), step, "-" if job.loss is None else f"{job.loss:.4f}",
                      str(job.restarts), _age(time.time() - job.created_at), f"{cost.node_hours:,.2f}",
                      _dollars(cost.spent_usd), _dollars(cost.predicted_usd))
    return table


def _nodes_table(nodes: list[Node]) -> Table:
    table = Table(box=None, header_style="bold", padding=(0, 2, 0, 0))
    for column in ("NODE", "RANK", "WHERE", "STATE", "HEARTBEAT", "NOTE"):
        table.add_column(column)
    now = time.time()
    for n in nodes:
        table.add_row(n.id, "spare" if n.rank is None else str(n.rank), _where(n), n.state.value,
                      _age(None if n.heartbeat_at is None else now - n.heartbeat_at), n.failure)
    return table


def job_panel(store: Store, job: Job, log_tail: list[str]) -> Panel:
    p = progress(job)
    head = Text.assemble(
        (f"job {job.id} ", "bold"), (job.name, "bold"), "  ",
        (job.state.value, _STATE_STYLE.get(job.state, "")),
        f"  attempt {job.attempt}  restarts {job.restarts}  {_age((job.finished_at or time.time()) - job.created_at)}")
    figures = Text(
        f"step {p['step']}" + (f"/{p['total_steps']}" if p["total_steps"] else "")
        + ("" if job.loss is None else f"   loss {job.loss:.4f}")
        + ("" if p["step_time_s"] is None else f"   {p['step_time_s'] * 1000:.0f} ms/step   "
           f"{p['steps_per_s']:.1f} steps/s")
        + ("" if p["eta_s"] is None or job.state.terminal else f"   ETA {_age(p['eta_s'])}")
        + ("" if job.checkpoint_step is None else f"   checkpoint @ step {job.checkpoint_step}"))
    nodes = store.nodes(job.id)
    parts: list[Any] = [head, figures, Text(f"cost: {cost_text(job_cost(job, nodes), job.spec)}"),
                        _nodes_table([n for n in nodes if job.state.terminal or n.state.active])]
    if job.error:
        parts.append(Text(f"error: {job.error}", style="red"))
    if log_tail:
        parts.append(Text("\n".join(log_tail), style="dim"))
    return Panel(Group(*parts), title="tfsn", expand=True)


LOG_CHUNK_BYTES = 1 << 20   # a job log is read this much at a time: it grows to gigabytes (MAX_JOB_LOG_BYTES)


def _read_new(log: Path, offset: int) -> tuple[list[str], int]:
    """The whole lines of `log` after `offset`, at most LOG_CHUNK_BYTES of them (a longer line comes in pieces),
    and the offset after them."""
    if not log.exists():
        return [], offset
    with open(log, "rb") as f:
        f.seek(offset)
        data = f.read(LOG_CHUNK_BYTES)
    end = data.rfind(b"\n") + 1 or (len(data) if len(data) == LOG_CHUNK_BYTES else 0)   # only whole lines
    return data[:end].decode(errors="replace").splitlines(), offset + end


def _read_all_new(log: Path, offset: int, take: Callable[[list[str]], None]) -> int:
    """Pass the whole lines of `log` after `offset` to `take`, a chunk at a time; the offset after them. Read at
    once, the log of a long job took twice its size in memory (gigabytes) and minutes before anything showed."""
    while True:
        lines, after = _read_new(log, offset)
        if after == offset:
            return offset
        take(lines)
        offset = after


def print_log(log: Path, out: TextIO) -> None:
    """Copy a job log to `out` a chunk at a time (undecodable bytes replaced)."""
    if not log.exists():
        return
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(log, "rb") as f:
        while chunk := f.read(LOG_CHUNK_BYTES):
            out.write(decoder.decode(chunk))
    out.write(decoder.decode(b"", final=True))


KEEP_ALIVE_S = 5.0   # how often `follow` checks that the job's controller still runs


def follow(store: Store, job_id: int, log: Path, console: Console, poll_s: float = 0.5,
           keep_alive: Callable[[], None] | None = None) -> Job:
    """Show the job until it ends: a live panel on a terminal, plain lines otherwise. `keep_alive` is called
    every KEEP_ALIVE_S while it runs: a job whose controller died would never end, and show nothing more."""
    tail: deque[str] = deque(maxlen=8)
    offset, checked = 0, time.monotonic()

    def running(job: Job) -> bool:
        nonlocal checked
        if job.state.terminal:
            return False
        if keep_alive is not None and time.monotonic() - checked >= KEEP_ALIVE_S:
            keep_alive()
            checked = time.monotonic()
        return True

    if console.is_terminal:
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            while True:
                offset = _read_all_new(log, offset, lambda lines: tail.extend(line[:console.width - 6] for line in lines))
                job = store.job(job_id)
                live.update(job_panel(store, job, list(tail)))
                if not running(job):
                    return job
                time.sleep(poll_s)
    def show(lines: list[str]) -> None:
        for line in lines:
            console.print(line, markup=False, highlight=False)

    while True:  # not a terminal: stream the job log as it grows
        offset = _read_all_new(log, offset, show)
        job = store.job(job_id)
        if not running(job):
            _read_all_new(log, offset, show)
            return job
        time.sleep(poll_s)
