"""The job store: SQLite under `$TFSN_HOME`, the single source of truth for jobs and nodes.

The controller keeps no state that matters in memory: everything it decides is written here
first, so a controller killed with `kill -9` and started again picks up where it was. The CLI
reads the store directly and writes only requests (a new job, a stop) that the controller acts on.
Every node is recorded (state REQUESTED) before the provider is asked for it, so a crash between
the two never leaks a node: the controller reconciles REQUESTED nodes on start.
"""
from __future__ import annotations

import enum
import json
import secrets
import sqlite3
import statistics
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable


class JobState(str, enum.Enum):
    PENDING = "PENDING"
    PROVISIONING = "PROVISIONING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


_TRANSITIONS = {
    JobState.PENDING: {JobState.PROVISIONING, JobState.FAILED, JobState.STOPPED},
    JobState.PROVISIONING: {JobState.RUNNING, JobState.FAILED, JobState.STOPPED},
    JobState.RUNNING: {JobState.RECOVERING, JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED},
    JobState.RECOVERING: {JobState.RUNNING, JobState.FAILED, JobState.STOPPED},
}


class NodeState(str, enum.Enum):
    REQUESTED = "REQUESTED"    # recorded; the provider may or may not have been asked yet
    STARTING = "STARTING"      # the provider created it; its agent has not reported ready
    READY = "READY"            # the agent ran setup and takes commands
    FAILED = "FAILED"          # blamed for a failure; being or been terminated
    TERMINATED = "TERMINATED"  # torn down

    @property
    def active(self) -> bool:
        return self in (NodeState.REQUESTED, NodeState.STARTING, NodeState.READY)


SEE_JOBS = "To fix: run `tfsn ls` to see the jobs"     # the fix for a job id or name the store has not


class StoreError(Exception):
    """An invalid request to the store (unknown job, forbidden transition)."""


@dataclass
class Job:
    id: int
    name: str
    state: JobState
    spec: dict[str, Any]          # the validated JobSpec as JSON
    spec_path: str
    token: str                    # secret shared with the job's agents and SDK
    created_at: float
    updated_at: float
    attempt: int = 0              # number of times the workers were started
    attempt_state: str = "idle"   # idle | running | stopping
    attempt_changed_at: float = 0.0
    attempt_started_at: float = 0.0
    master_port: int = 0
    restarts: int = 0
    stop_requested: int = 0
    error: str = ""
    last_failure: str = ""        # signature of the previous attempt's failure
    step: int = 0                 # newest step reported by rank 0
    loss: float | None = None
    step_time: float | None = None
    restored_step: int | None = None
    checkpoint_step: int | None = None
    checkpoint_path: str = ""
    finished_at: float | None = None
    checkpoint_at: float = 0.0     # when the newest checkpoint was reported saved
    checkpoint_request: float = 0.0  # when the controller last asked for a checkpoint now
    pending_replace: str = ""      # node to replace once the requested checkpoint is saved
    pending_reason: str = ""
    plan: list[dict[str, Any]] = field(default_factory=list)     # ranked candidates (planner.PlannedOffer.to_dict)
    blocked: list[dict[str, Any]] = field(default_factory=list)  # failed provisioning attempts: what they blocked
    health: dict[str, Any] = field(default_factory=dict)         # the health policy's state (Policy.state())
    artifacts: dict[str, str] = field(default_factory=dict)      # what its cloud nodes fetch: "code", "wheel" sha256


@dataclass
class Node:
    id: str
    job_id: int
    rank: int | None              # None for a spare
    provider: str
    state: NodeState
    handle: dict[str, Any] | None
    created_at: float
    updated_at: float
    heartbeat_at: float | None = None
    agent_state: str = ""         # what the agent last said it is doing
    failure: str = ""
    offer: dict[str, Any] | None = None  # the planned offer it was requested on (providers.base.Offer fields)
    spot: bool = False
    addr: str = ""                # the address its agent reported (rank 0's is the workers' rendezvous)
    host: str = ""                # the machine under it, as its agent reported (a Kubernetes node, ...)
    provisioned_at: float | None = None  # when the provider confirmed it (its start timeout counts from then)
    released: bool = False        # the provider confirmed it is deleted (or it never existed)
    released_at: float | None = None  # when the provider first confirmed it (the end of its bill)
    boot_failure: str = ""        # the end of its boot log, when its boot script reported a failure


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL, state TEXT NOT NULL, spec TEXT NOT NULL, spec_path TEXT NOT NULL,
    token TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0, attempt_state TEXT NOT NULL DEFAULT 'idle',
    attempt_changed_at REAL NOT NULL DEFAULT 0, attempt_started_at REAL NOT NULL DEFAULT 0, master_port INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0, stop_requested INTEGER NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '', last_failure TEXT NOT NULL DEFAULT '',
    step INTEGER NOT NULL DEFAULT 0, loss REAL, step_time REAL, restored_step INTEGER,
    checkpoint_step INTEGER, checkpoint_path TEXT NOT NULL DEFAULT '', finished_at REAL,
    checkpoint_at REAL NOT NULL DEFAULT 0, checkpoint_request REAL NOT NULL DEFAULT 0,
    pending_replace TEXT NOT NULL DEFAULT '', pending_reason TEXT NOT NULL DEFAULT '',
    plan TEXT NOT NULL DEFAULT '[]', blocked TEXT NOT NULL DEFAULT '[]', health TEXT NOT NULL DEFAULT '{}',
    artifacts TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY, job_id INTEGER NOT NULL REFERENCES jobs(id), rank INTEGER,
    provider TEXT NOT NULL, state TEXT NOT NULL, handle TEXT, created_at REAL NOT NULL,
    updated_at REAL NOT NULL, heartbeat_at REAL, agent_state TEXT NOT NULL DEFAULT '',
    failure TEXT NOT NULL DEFAULT '', offer TEXT, spot INTEGER NOT NULL DEFAULT 0,
    addr TEXT NOT NULL DEFAULT '', host TEXT NOT NULL DEFAULT '', provisioned_at REAL,
    released INTEGER NOT NULL DEFAULT 0, released_at REAL, boot_failure TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS nodes_job ON nodes(job_id);
CREATE TABLE IF NOT EXISTS results (
    job_id INTEGER NOT NULL, node_id TEXT NOT NULL, attempt INTEGER NOT NULL,
    returncode INTEGER NOT NULL, signal INTEGER, stopped INTEGER NOT NULL, summary TEXT NOT NULL,
    reported_at REAL NOT NULL,
    PRIMARY KEY (job_id, node_id, attempt)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id INTEGER NOT NULL, at REAL NOT NULL,
    kind TEXT NOT NULL, message TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id, id);
CREATE TABLE IF NOT EXISTS steps (
    job_id INTEGER NOT NULL, attempt INTEGER NOT NULL, rank INTEGER NOT NULL, step INTEGER NOT NULL,
    at REAL NOT NULL, step_time REAL NOT NULL, metrics TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS steps_job ON steps(job_id, attempt, step);
CREATE TABLE IF NOT EXISTS ranks (
    job_id INTEGER NOT NULL, rank INTEGER NOT NULL, attempt INTEGER NOT NULL, step INTEGER NOT NULL,
    at REAL NOT NULL, step_time REAL NOT NULL, PRIMARY KEY (job_id, rank)
);
"""

_JSON_FIELDS = ("spec", "plan", "blocked", "health", "artifacts")   # job fields stored as JSON text
# For a store made by an older tfsn, a column the schema has and the store lacks is added with its
# definition in _SCHEMA (so a new column can never be forgotten here), except where an older
# store needs another default than a new one.
_OLD_STORE_DEFAULTS = {
    # nodes of a store made before this column: their termination was taken as confirmed then
    ("nodes", "released"): "released INTEGER NOT NULL DEFAULT 1",
}


def _schema_columns() -> dict[str, dict[str, str]]:
    """Every table's column definitions in _SCHEMA, by name: SQLite itself reads the schema (into
    a database in memory) and says each column's type, NOT NULL and default."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(_SCHEMA)
        tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                  if not row[0].startswith("sqlite_")]
        return {table: {name: f"{name} {ctype}" + (" NOT NULL" if notnull else "")
                        + ("" if default is None else f" DEFAULT {default}")
                        for _, name, ctype, notnull, default, _ in db.execute(f"PRAGMA table_info({table})")}
                for table in tables}
    finally:
        db.close()


@dataclass(frozen=True)
class Result:
    node_id: str
    attempt: int
    returncode: int
    signal: int | None    # the signal that killed the first failing worker, if one did
    stopped: bool         # the agent stopped the workers because the controller said so
    summary: str          # the last lines of output, for the error shown to the user
    reported_at: float


@dataclass(frozen=True)
class Event:
    id: int
    job_id: int
    at: float
    kind: str
    message: str


def _first(rows: list[sqlite3.Row]) -> sqlite3.Row | None:
    return rows[0] if rows else None


def _encoded(changes: dict[str, Any]) -> dict[str, Any]:
    """Job field changes as SQLite values (the list fields are stored as JSON)."""
    return {k: json.dumps(v) if k in _JSON_FIELDS else v for k, v in changes.items()}


def _json_or_none(value: str | None) -> Any:
    return None if value is None else json.loads(value)


def _immutable(path: Path) -> sqlite3.Connection:
    """A store on a read-only disk, opened without the -shm file SQLite would make: its WAL was checkpointed when
    its last writer closed it (SQLite opens one that still has its -shm for reading the usual way)."""
    return sqlite3.connect(f"{Path(path).resolve().as_uri()}?immutable=1", uri=True, check_same_thread=False,
                           isolation_level=None)


class Store:
    """Thread-safe access to the SQLite store (WAL mode, so the CLI reads while the controller writes)."""

    def __init__(self, path: Path, read_only: bool = False) -> None:
        """`read_only`: a store on a disk nothing can write, read as it is (see `_immutable`)."""
        self.path = path
        self._lock = threading.RLock()
        self._db = _immutable(path) if read_only else sqlite3.connect(path, timeout=30, check_same_thread=False,
                                                                        isolation_level=None)
        self._db.row_factory = sqlite3.Row
        if read_only:
            self.owner, self.on_change = (self._db.execute("SELECT value FROM meta WHERE key = 'owner'").fetchone()
                                          or [""])[0], None
            return
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=30000")
        self._db.executescript(_SCHEMA)
        self._migrate()
        # This store's own id, made once: job ids restart at 1 in every store, so the clouds' resources carry it
        # too, and `tfsn down` run from another store (TFSN_HOME, machine, colleague) leaves them alone.
        self.owner: str = self._owner()
        for part in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):   # every job's secret is in there
            if str(path) != ":memory:" and part.exists() and part.stat().st_mode & 0o777 != 0o600:
                part.chmod(0o600)
        # Called with a job's id after a write to the job or one of its nodes commits (not for telemetry):
        # the Kubernetes operator copies the job into its TfsnJob's status, the store that outlives it.
        self.on_change: Callable[[int], None] | None = None

    def _migrate(self) -> None:
        """Add the columns that a store made by an older tfsn lacks, so upgrading never loses its jobs."""
        for table, columns in _schema_columns().items():
            have = {row["name"] for row in self._db.execute(f"PRAGMA table_info({table})")}
            for name, definition in columns.items():
                if name not in have:
                    definition = _OLD_STORE_DEFAULTS.get((table, name), definition)
                    try:
                        self._db.execute(f"ALTER TABLE {table} ADD COLUMN {definition}")
                    except sqlite3.OperationalError as err:   # another process added it just now
                        if "duplicate column" not in str(err):
                            raise

    def _owner(self) -> str:
        """The store's id, written by whichever process opens it first (read only, after that)."""
        row = self._db.execute("SELECT value FROM meta WHERE key = 'owner'").fetchone()
        if row is None:
            self._db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('owner', ?)", (secrets.token_hex(6),))
            row = self._db.execute("SELECT value FROM meta WHERE key = 'owner'").fetchone()
        return row[0]

    def close(self) -> None:
        self._db.close()

    def _tx(self) -> "_Transaction":
        return _Transaction(self._db, self._lock)

    def _query(self, sql: str, args: tuple | list = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _changed(self, job_id: int | None) -> None:
        """Tell the listener (outside the transaction: it may be slow or write again)."""
        if self.on_change is not None and job_id is not None:
            self.on_change(job_id)

    def _job_of_node(self, db: sqlite3.Connection, node_id: str) -> int | None:
        """The job of a node just written, when someone listens for changes."""
        if self.on_change is None:
            return None
        row = db.execute("SELECT job_id FROM nodes WHERE id = ?", (node_id,)).fetchone()
        return None if row is None else row["job_id"]

    # ---- jobs -----------------------------------------------------------------------------------
    def create_job(self, name: str, spec: dict[str, Any], spec_path: str, token: str,
                   guard: Callable[[list[Job]], None] | None = None) -> Job:
        """A new PENDING job. `guard`, given the jobs not yet ended, may refuse it by raising: it runs in the
        transaction that inserts the job, so two launches at once cannot both pass it."""
        now = time.time()
        with self._tx() as db:
            if guard is not None:
                guard(self.jobs(active_only=True))
            cur = db.execute(
                "INSERT INTO jobs (name, state, spec, spec_path, token, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (name, JobState.PENDING.value, json.dumps(spec), spec_path, token, now, now))
            job_id = cur.lastrowid
            db.execute("INSERT INTO events (job_id, at, kind, message) VALUES (?, ?, 'state', 'PENDING')",
                       (job_id, now))
        self._changed(job_id)
        return self.job(job_id)

    def restore(self, job: Job, nodes: list[Node], message: str) -> bool:
        """Insert a job and its nodes as recorded elsewhere (a TfsnJob's status), under their own ids, so
        that the agents still running with those ids are recognized; False if the job id is taken."""
        with self._tx() as db:
            if db.execute("SELECT 1 FROM jobs WHERE id = ?", (job.id,)).fetchone() is not None:
                return False
            row = _encoded({f.name: getattr(job, f.name) for f in fields(Job)})
            row["state"] = job.state.value
            db.execute(f"INSERT INTO jobs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))
            for node in nodes:
                values = {f.name: getattr(node, f.name) for f in fields(Node)}
                values.update(state=node.state.value, handle=None if node.handle is None else json.dumps(node.handle),
                              offer=None if node.offer is None else json.dumps(node.offer),
                              spot=int(node.spot), released=int(node.released))
                db.execute(f"INSERT INTO nodes ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                           tuple(values.values()))
            db.execute("INSERT INTO events (job_id, at, kind, message) VALUES (?, ?, 'state', ?)",
                       (job.id, time.time(), message))
        self._changed(job.id)
        return True

    def reserve_job_ids(self, up_to: int) -> None:
        """New jobs get ids above `up_to` from now on: ids held by jobs recorded elsewhere (TfsnJobs' status)
        and restored later must never be given to a new job meanwhile."""
        with self._tx() as db:   # sqlite_sequence holds the largest id AUTOINCREMENT has given out
            db.execute("UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = 'jobs'", (up_to,))
            db.execute("INSERT INTO sqlite_sequence (name, seq) SELECT 'jobs', ? WHERE NOT EXISTS "
                       "(SELECT 1 FROM sqlite_sequence WHERE name = 'jobs')", (up_to,))

    def job(self, job_id: int) -> Job:
        row = _first(self._query("SELECT * FROM jobs WHERE id = ?", (job_id,)))
        if row is None:
            raise StoreError(f"no job with id {job_id}. {SEE_JOBS}")
        return self._job(row)

    def find_job(self, ref: str) -> Job:
        """A job by id, or the newest job with that name."""
        if ref.isascii() and ref.isdigit() and len(ref) < 18:
            return self.job(int(ref))
        row = _first(self._query("SELECT * FROM jobs WHERE name = ? ORDER BY id DESC LIMIT 1", (ref,)))
        if row is None:
            raise StoreError(f"no job with id or name '{ref}'. {SEE_JOBS}")
        return self._job(row)

    def jobs(self, active_only: bool = False) -> list[Job]:
        rows = self._query("SELECT * FROM jobs ORDER BY id")
        jobs = [self._job(r) for r in rows]
        return [j for j in jobs if not j.state.terminal] if active_only else jobs

    @staticmethod
    def _job(row: sqlite3.Row) -> Job:
        values = dict(row)
        values["state"] = JobState(values["state"])
        for name in _JSON_FIELDS:
            values[name] = json.loads(values[name])
        return Job(**{f.name: values[f.name] for f in fields(Job)})

    def update_job(self, job_id: int, **changes: Any) -> None:
        if not changes:
            return
        allowed = {f.name for f in fields(Job)} - {"id", "state", "created_at", "spec", "token"}
        unknown = set(changes) - allowed
        if unknown:
            raise StoreError(f"cannot update job fields {sorted(unknown)}")
        changes = _encoded(changes)
        changes["updated_at"] = time.time()
        cols = ", ".join(f"{k} = ?" for k in changes)
        with self._tx() as db:
            db.execute(f"UPDATE jobs SET {cols} WHERE id = ?", (*changes.values(), job_id))
        self._changed(job_id)

    def transition(self, job_id: int, new: JobState, message: str = "", **changes: Any) -> None:
        """Move a job to `new` (with other field changes in the same transaction), logging an event."""
        now = time.time()
        with self._tx() as db:
            row = db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise StoreError(f"no job with id {job_id}. {SEE_JOBS}")
            old = JobState(row["state"])
            if old == new:
                return
            if new not in _TRANSITIONS.get(old, set()):
                raise StoreError(f"job {job_id}: forbidden transition {old.value} -> {new.value}")
            changes = _encoded(changes)
            changes.update(state=new.value, updated_at=now)
            if new.terminal:
                changes["finished_at"] = now
            cols = ", ".join(f"{k} = ?" for k in changes)
            db.execute(f"UPDATE jobs SET {cols} WHERE id = ?", (*changes.values(), job_id))
            text = new.value + (f": {message}" if message else "")
            db.execute("INSERT INTO events (job_id, at, kind, message) VALUES (?, ?, 'state', ?)",
                       (job_id, now, text))
        self._changed(job_id)

    def request_stop(self, job_id: int) -> None:
        self.update_job(job_id, stop_requested=1)

    # ---- nodes ----------------------------------------------------------------------------------
    def add_node(self, node_id: str, job_id: int, rank: int | None, provider: str,
                 offer: dict[str, Any] | None = None, spot: bool = False) -> Node:
        """Record a node before it is requested (the intent that a restarted controller reconciles)."""
        now = time.time()
        with self._tx() as db:
            db.execute("INSERT INTO nodes (id, job_id, rank, provider, state, created_at, updated_at, offer, spot, "
                       "released) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                       (node_id, job_id, rank, provider, NodeState.REQUESTED.value, now, now,
                        None if offer is None else json.dumps(offer), int(spot)))
        self._changed(job_id)
        return self.node(node_id)

    def node(self, node_id: str) -> Node:
        row = _first(self._query("SELECT * FROM nodes WHERE id = ?", (node_id,)))
        if row is None:
            raise StoreError(f"no node with id {node_id}")
        return self._node(row)

    def nodes(self, job_id: int, active_only: bool = False) -> list[Node]:
        rows = self._query("SELECT * FROM nodes WHERE job_id = ? ORDER BY created_at, id", (job_id,))
        nodes = [self._node(r) for r in rows]
        return [n for n in nodes if n.state.active] if active_only else nodes

    @staticmethod
    def _node(row: sqlite3.Row) -> Node:
        values = dict(row)
        values["state"] = NodeState(values["state"])
        values["handle"] = _json_or_none(values["handle"])
        values["offer"] = _json_or_none(values["offer"])
        values["spot"] = bool(values["spot"])
        values["released"] = bool(values["released"])
        return Node(**values)

    def update_node(self, node_id: str, **changes: Any) -> None:
        if "state" in changes:
            changes["state"] = NodeState(changes["state"]).value
        if "handle" in changes:
            changes["handle"] = json.dumps(changes["handle"])
        changes["updated_at"] = time.time()
        cols = ", ".join(f"{k} = ?" for k in changes)
        with self._tx() as db:
            db.execute(f"UPDATE nodes SET {cols} WHERE id = ?", (*changes.values(), node_id))
            if changes.get("released"):   # the first confirmation ends the node's bill; a repeated one does not move it
                db.execute("UPDATE nodes SET released_at = ? WHERE id = ? AND released_at IS NULL",
                           (changes["updated_at"], node_id))
            job_id = self._job_of_node(db, node_id)
        self._changed(job_id)

    def unreleased_nodes(self) -> list[Node]:
        """Nodes out of their job (failed or torn down) whose deletion the provider has not confirmed."""
        rows = self._query("SELECT * FROM nodes WHERE released = 0 AND state IN (?, ?) ORDER BY created_at",
                           (NodeState.FAILED.value, NodeState.TERMINATED.value))
        return [self._node(r) for r in rows]

    def promote_node(self, node_id: str, expected: NodeState, new: NodeState) -> bool:
        """Move a node from `expected` to `new` only if it is still in `expected` (compare-and-set)."""
        with self._tx() as db:
            cur = db.execute("UPDATE nodes SET state = ?, updated_at = ? WHERE id = ? AND state = ?",
                             (new.value, time.time(), node_id, expected.value))
            promoted, job_id = cur.rowcount == 1, self._job_of_node(db, node_id)
        if promoted:
            self._changed(job_id)
        return promoted

    # ---- results, events, telemetry ---------------------------------------------------------------
    def record_result(self, job_id: int, node_id: str, attempt: int, returncode: int,
                      signal: int | None, stopped: bool, summary: str) -> None:
        """A node's workers exited; idempotent for retried reports."""
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (job_id, node_id, attempt, returncode, signal, int(stopped), summary, time.time()))

    def results(self, job_id: int, attempt: int) -> list[Result]:
        rows = self._query("SELECT node_id, attempt, returncode, signal, stopped, summary, reported_at FROM results "
                           "WHERE job_id = ? AND attempt = ? ORDER BY reported_at", (job_id, attempt))
        return [Result(**{**dict(r), "stopped": bool(r["stopped"])}) for r in rows]

    def add_event(self, job_id: int, kind: str, message: str) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO events (job_id, at, kind, message) VALUES (?, ?, ?, ?)",
                       (job_id, time.time(), kind, message))

    def events(self, job_id: int, after_id: int = 0) -> list[Event]:
        rows = self._query("SELECT * FROM events WHERE job_id = ? AND id > ? ORDER BY id", (job_id, after_id))
        return [Event(**dict(r)) for r in rows]

    def record_steps(self, job_id: int, attempt: int, rank: int, records: list[dict[str, Any]]) -> None:
        """Step records from one rank: rank 0's are kept in full, every rank's newest in `ranks`."""
        if not records:
            return
        last = records[-1]
        with self._tx() as db:
            if rank == 0:
                db.executemany(
                    "INSERT INTO steps VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [(job_id, attempt, rank, r["step"], r["at"], r["step_time"], json.dumps(r.get("metrics", {})))
                     for r in records])
                loss = last.get("metrics", {}).get("loss")
                step_time = statistics.median(r["step_time"] for r in records)  # not one slow step
                db.execute("UPDATE jobs SET step = ?, step_time = ?, loss = COALESCE(?, loss), updated_at = ? "
                           "WHERE id = ?", (last["step"], step_time, loss, time.time(), job_id))
            db.execute("INSERT OR REPLACE INTO ranks VALUES (?, ?, ?, ?, ?, ?)",
                       (job_id, rank, attempt, last["step"], last["at"], last["step_time"]))

    def steps(self, job_id: int, attempt: int | None = None) -> list[dict[str, Any]]:
        """Rank 0's step records, oldest first."""
        query, args = "SELECT * FROM steps WHERE job_id = ?", [job_id]
        if attempt is not None:
            query, args = query + " AND attempt = ?", [job_id, attempt]
        rows = self._query(query + " ORDER BY at", args)
        return [{**dict(r), "metrics": json.loads(r["metrics"])} for r in rows]


class _Transaction:
    """`with` block = one IMMEDIATE transaction under the store's lock."""

    def __init__(self, db: sqlite3.Connection, lock: threading.RLock) -> None:
        self.db, self.lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.db

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.lock.release()


