"""The controller's journal in SQLite: jobs (spec, state, progress, newest committed
checkpoint step, preemptions), their per-step metrics (with each MoE layer's routing and
the traffic measured between slices), the gangs the controller started and the counters its ids come from. What a job did is still
there after it ended, and a controller restarted on the same state directory finds the jobs
it has to continue (controller/jobs.py), the gangs that were lost with the old process, and
numbers ids after the old ones (an old id never names a new object)."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    spec TEXT NOT NULL,          -- JSON: program, overrides, slices, mesh, steps, client,
                                 -- checkpoint directory and interval
    state TEXT NOT NULL,
    step INTEGER NOT NULL DEFAULT 0,
    gang_id TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '',
    epoch INTEGER NOT NULL DEFAULT 0,
    flops_per_step REAL NOT NULL DEFAULT 0,
    committed_step INTEGER,      -- the newest checkpoint step known committed; NULL: none
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS step_metrics (
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    loss REAL, grad_norm REAL, learning_rate REAL,
    step_time_s REAL, tokens_per_s REAL, wall_time REAL,
    experts TEXT NOT NULL DEFAULT '[]',  -- JSON: the step's ExpertLoads, see _experts_json
    dcn_bytes REAL NOT NULL DEFAULT 0,
    dcn_segments REAL NOT NULL DEFAULT 0,
    dcn_window INTEGER NOT NULL DEFAULT 0,  -- 0: the step carries no DCN measurement
    PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS gangs (
    gang_id TEXT PRIMARY KEY,
    client TEXT NOT NULL,
    slices TEXT NOT NULL,        -- JSON list of slice names
    created_at REAL NOT NULL,
    ended_at REAL,               -- NULL: running when last heard of
    why TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
"""


# Columns added to tables after their first release, with their SQL types: a journal
# written before them gets them when it is opened.
_ADDED_JOB_COLUMNS = {
    "committed_step": "INTEGER",
    "preemptions": "INTEGER NOT NULL DEFAULT 0",
    "resumed_from_step": "INTEGER",
    "restarts": "INTEGER NOT NULL DEFAULT 0",
    "failures": "INTEGER NOT NULL DEFAULT 0",
    "keep_steps": "TEXT NOT NULL DEFAULT '[]'",  # JSON: checkpoint steps marked to keep
    "recoveries": "TEXT NOT NULL DEFAULT '[]'",  # JSON: job.Recovery records, oldest first
}
_ADDED_STEP_COLUMNS = {
    "experts": "TEXT NOT NULL DEFAULT '[]'",  # JSON: the step's ExpertLoads
    "dcn_bytes": "REAL NOT NULL DEFAULT 0",
    "dcn_segments": "REAL NOT NULL DEFAULT 0",
    "dcn_window": "INTEGER NOT NULL DEFAULT 0",
}
_ADDED_COLUMNS = {"jobs": _ADDED_JOB_COLUMNS, "step_metrics": _ADDED_STEP_COLUMNS}


@dataclass(frozen=True)
class ExpertLoad:
    """How one Mixture-of-Experts layer routed its tokens in one step.

    Attributes:
        layer: the layer's index among the model's MoE layers (0-based), not among all
            its layers.
        tokens_per_expert: per expert, the expert choices (token, expert pairs) it
            served this step, after the choices over its capacity were dropped.
        dropped_fraction: the choices dropped for capacity over all choices made.
        local_fraction: of the served choices, the share whose expert sits on the token's
            own slice (1.0 when the experts do not span slices); the rest crossed DCN.
        tokens_by_slice: `tokens_per_expert` split by the slice that holds the token, one
            row per slice (what load-aware placement decides from); () if not reported.
    """

    layer: int
    tokens_per_expert: tuple[int, ...]
    dropped_fraction: float
    local_fraction: float
    tokens_by_slice: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class StepRecord:
    """What one training step measured. `step_time_s` is how long the step ran on the
    gang as its workers measured it (the slowest host's time, see jobs.step_seconds),
    `tokens_per_s` the step's tokens over that time, and `wall_time` when the step
    finished (seconds since the epoch, by the clock of the host that finished last).

    `dcn_bytes` and `dcn_segments` are the traffic measured between slices per step (TCP
    payload bytes and data segments between worker processes of different slices, on the
    simulation), averaged over the last `dcn_window` steps; `dcn_window` 0 means the step
    carries no measurement."""

    step: int
    loss: float
    grad_norm: float
    learning_rate: float
    step_time_s: float
    tokens_per_s: float
    wall_time: float
    experts: tuple[ExpertLoad, ...] = ()  # one per MoE layer, by layer; () if none
    dcn_bytes: float = 0.0
    dcn_segments: float = 0.0
    dcn_window: int = 0


def _experts_json(experts: Iterable[ExpertLoad]) -> str:
    """The `experts` column: a compact JSON list with one
    `[layer, [tokens per expert...], dropped_fraction, local_fraction, [[by slice...]...]]`
    per layer, e.g. `[[0,[12,30,7,0],0.021,0.63,[[10,20,0,0],[2,10,7,0]]]]` (rows written
    before the per-slice split have four entries). The casts take NumPy scalars, which json
    cannot."""
    rows = [
        [
            int(e.layer),
            [int(n) for n in e.tokens_per_expert],
            float(e.dropped_fraction),
            float(e.local_fraction),
            [[int(n) for n in row] for row in e.tokens_by_slice],
        ]
        for e in experts
    ]
    return json.dumps(rows, separators=(",", ":"))


def _experts_from_json(text: str) -> tuple[ExpertLoad, ...]:
    return tuple(
        ExpertLoad(
            int(layer),
            tuple(int(n) for n in tokens),
            float(dropped),
            float(local),
            tuple(tuple(int(n) for n in row) for row in (by_slice[0] if by_slice else ())),
        )
        for layer, tokens, dropped, local, *by_slice in json.loads(text)
    )


def _step_record(row: tuple[Any, ...]) -> StepRecord:
    """A row of `step_metrics`, its columns in the order `Journal.steps` selects them."""
    step, loss, grad_norm, lr, seconds, rate, wall, experts, dcn_bytes, segments, window = row
    return StepRecord(
        step,
        loss,
        grad_norm,
        lr,
        seconds,
        rate,
        wall,
        _experts_from_json(experts),
        float(dcn_bytes),
        float(segments),
        int(window),
    )


class Journal:
    """A small SQLite store; every write is committed at once (WAL, so reads never block)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            for table, added in _ADDED_COLUMNS.items():
                have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
                for name, kind in added.items():
                    if name not in have:
                        self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def next_job_number(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM jobs").fetchone()
        return int(row[0]) + 1

    def next_number(self, name: str) -> int:
        """The next number of counter `name` (1, 2, ...), durably taken: after a restart
        the counter goes on from the last number handed out."""
        with self._lock:
            row = self._db.execute(
                "INSERT INTO counters (name, value) VALUES (?, 1) "
                "ON CONFLICT(name) DO UPDATE SET value = value + 1 RETURNING value",
                (name,),
            ).fetchone()
        return int(row[0])

    # -- gangs ------------------------------------------------------------------------

    def add_gang(self, gang_id: str, client: str, slices: Iterable[str], now: float) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO gangs (gang_id, client, slices, created_at) "
                "VALUES (?, ?, ?, ?)",
                (gang_id, client, json.dumps(list(slices)), now),
            )

    def end_gang(self, gang_id: str, why: str, now: float) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE gangs SET ended_at = ?, why = ? WHERE gang_id = ? AND ended_at IS NULL",
                (now, why, gang_id),
            )

    def ended_gangs(self, limit: int) -> list[tuple[str, str]]:
        """(gang id, why it ended) of the newest `limit` gangs recorded as ended, oldest
        first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT gang_id, why FROM gangs WHERE ended_at IS NOT NULL "
                "ORDER BY ended_at DESC LIMIT ?",
                (limit,),
            ).fetchall()
        return [(str(g), str(w)) for g, w in reversed(rows)]

    def running_gangs(self) -> list[tuple[str, str]]:
        """(gang id, client) of the gangs not recorded as ended, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT gang_id, client FROM gangs WHERE ended_at IS NULL ORDER BY created_at"
            ).fetchall()
        return [(str(g), str(c)) for g, c in rows]

    def add_job(self, job_id: str, seq: int, spec: dict[str, Any], state: str, now: float) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (job_id, seq, spec, state, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, seq, json.dumps(spec), state, now, now),
            )

    def update_job(self, job_id: str, now: float, **fields: Any) -> None:
        allowed = {
            "state",
            "step",
            "gang_id",
            "error",
            "epoch",
            "flops_per_step",
            "committed_step",
            "preemptions",
            "resumed_from_step",
            "restarts",
            "failures",
            "keep_steps",
            "recoveries",
        }
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown job fields {sorted(unknown)}")
        names = ", ".join(f"{k} = ?" for k in fields)
        with self._lock:
            self._db.execute(
                f"UPDATE jobs SET {names}, updated_at = ? WHERE job_id = ?",
                (*fields.values(), now, job_id),
            )

    def add_steps(self, job_id: str, records: Iterable[StepRecord]) -> None:
        rows = [
            (
                job_id,
                r.step,
                r.loss,
                r.grad_norm,
                r.learning_rate,
                r.step_time_s,
                r.tokens_per_s,
                r.wall_time,
                _experts_json(r.experts),
                float(r.dcn_bytes),
                float(r.dcn_segments),
                int(r.dcn_window),
            )
            for r in records
        ]
        with self._lock:
            self._db.executemany(
                "INSERT OR REPLACE INTO step_metrics (job_id, step, loss, grad_norm, "
                "learning_rate, step_time_s, tokens_per_s, wall_time, experts, dcn_bytes, "
                "dcn_segments, dcn_window) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )

    def steps(self, job_id: str, since: int = 0) -> list[StepRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT step, loss, grad_norm, learning_rate, step_time_s, tokens_per_s, "
                "wall_time, experts, dcn_bytes, dcn_segments, dcn_window FROM step_metrics "
                "WHERE job_id = ? AND step >= ? ORDER BY step",
                (job_id, since),
            ).fetchall()
        return [_step_record(row) for row in rows]

    def jobs(self) -> list[dict[str, Any]]:
        with self._lock:
            cursor = self._db.execute("SELECT * FROM jobs ORDER BY seq")
            names = [d[0] for d in cursor.description]
            rows = cursor.fetchall()
        out = []
        for row in rows:
            record = dict(zip(names, row, strict=True))
            record["spec"] = json.loads(record["spec"])
            record["keep_steps"] = json.loads(record["keep_steps"])
            record["recoveries"] = json.loads(record["recoveries"])
            out.append(record)
        return out
