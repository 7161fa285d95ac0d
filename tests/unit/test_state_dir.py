"""Where a controller keeps its state when not told, the lock that keeps two controllers
off one state directory (no processes: the lock is per open file), and the per-step MoE
routing and DCN traffic its journal keeps there (also in journals written before they were
kept)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from controller.journal import ExpertLoad, Journal, StepRecord
from controller.server import default_state_dir, lock_state_dir


def test_the_default_state_dir_is_per_user_and_per_simulated_cluster(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_state_dir(None) == tmp_path / "slicewise"
    assert default_state_dir("2xv5litepod-4") == tmp_path / "slicewise" / "sim-2xv5litepod-4"
    assert default_state_dir("v5litepod-16,v5litepod-4").name == "sim-v5litepod-16+v5litepod-4"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_state_dir(None) == Path.home() / ".local" / "state" / "slicewise"


def test_a_state_dir_is_taken_by_one_controller_at_a_time(tmp_path, caplog):
    state = tmp_path / "state"
    first = lock_state_dir(state)
    assert first is not None
    assert (state / "controller.lock").read_text().strip() == str(os.getpid())
    assert lock_state_dir(state) is None  # a second controller is refused...
    assert f"in use by another controller (pid {os.getpid()})" in caplog.text
    os.close(first)  # ...until the first one is gone (the kernel drops its lock)
    again = lock_state_dir(state)
    assert again is not None
    os.close(again)


ROUTED = (
    ExpertLoad(0, (12, 30, 7, 0), 0.021, 0.63, ((10, 20, 0, 0), (2, 10, 7, 0))),
    ExpertLoad(1, (10, 10, 10, 10), 0.0, 1.0),
)


def test_the_journal_keeps_each_steps_moe_routing(tmp_path):
    # What a worker's NumPy arrays give, which json alone cannot write.
    from_numpy = ExpertLoad(np.int64(0), tuple(np.array([3, 5])), np.float32(0.5), 1.0)
    journal = Journal(tmp_path / "j.sqlite")
    journal.add_steps(
        "j1",
        [
            StepRecord(0, 5.5, 1.0, 1e-3, 0.2, 5000.0, 100.5, ROUTED),
            StepRecord(1, 5.0, 0.9, 2e-3, 0.1, 10000.0, 100.6),  # a model without MoE
            StepRecord(2, 4.5, 0.8, 3e-3, 0.1, 10000.0, 100.7, (from_numpy,)),
        ],
    )
    journal.close()

    again = Journal(tmp_path / "j.sqlite")
    first, plain, numpy = again.steps("j1")
    assert first == StepRecord(0, 5.5, 1.0, 1e-3, 0.2, 5000.0, 100.5, ROUTED)
    assert plain.experts == ()
    assert numpy.experts == (ExpertLoad(0, (3, 5), 0.5, 1.0),)
    assert type(numpy.experts[0].tokens_per_expert[0]) is int
    raw = sqlite3.connect(tmp_path / "j.sqlite").execute(
        "SELECT experts FROM step_metrics WHERE step = 0"
    )
    assert raw.fetchone()[0] == (
        "[[0,[12,30,7,0],0.021,0.63,[[10,20,0,0],[2,10,7,0]]],[1,[10,10,10,10],0.0,1.0,[]]]"
    )


def test_routing_journalled_before_the_per_slice_split_still_reads(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    journal.add_steps("j1", [StepRecord(0, 5.5, 1.0, 1e-3, 0.2, 5000.0, 100.5, ROUTED)])
    journal.close()
    with sqlite3.connect(tmp_path / "j.sqlite") as db:  # as an older controller wrote it
        db.execute("UPDATE step_metrics SET experts = '[[0,[3,5],0.5,1.0]]'")
    assert Journal(tmp_path / "j.sqlite").steps("j1")[0].experts == (
        ExpertLoad(0, (3, 5), 0.5, 1.0),
    )


OLD_STEPS = """
CREATE TABLE step_metrics (
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    loss REAL, grad_norm REAL, learning_rate REAL,
    step_time_s REAL, tokens_per_s REAL, wall_time REAL,
    PRIMARY KEY (job_id, step)
);
INSERT INTO step_metrics VALUES ('j1', 0, 5.5, 1.0, 0.001, 0.2, 5000.0, 100.5);
"""


def test_a_journal_from_before_moe_routing_gains_the_column(tmp_path):
    path = tmp_path / "j.sqlite"
    db = sqlite3.connect(path)
    db.executescript(OLD_STEPS)
    db.close()

    journal = Journal(path)
    assert journal.steps("j1") == [StepRecord(0, 5.5, 1.0, 1e-3, 0.2, 5000.0, 100.5)]
    journal.add_steps("j1", [StepRecord(1, 5.0, 0.9, 2e-3, 0.1, 10000.0, 100.6, ROUTED)])
    journal.close()

    again = Journal(path)  # opening it twice adds nothing twice
    assert [s.experts for s in again.steps("j1")] == [(), ROUTED]


def test_the_journal_keeps_each_steps_measured_dcn_traffic(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    journal.add_steps(
        "j1",
        [
            StepRecord(0, 5.5, 1.0, 1e-3, 0.2, 5000.0, 100.5),  # measured nothing
            StepRecord(1, 5.0, 0.9, 2e-3, 0.1, 1e4, 100.6, ROUTED, 1.5e6, 410.5, 2),
            # What a worker's NumPy scalars give.
            StepRecord(2, 4.5, 0.8, 3e-3, 0.1, 1e4, 100.7, (), np.float64(2e3), np.int64(3), 1),
        ],
    )
    journal.close()

    again = Journal(tmp_path / "j.sqlite")
    unmeasured, measured, numpy = again.steps("j1")
    assert (unmeasured.dcn_bytes, unmeasured.dcn_segments, unmeasured.dcn_window) == (0, 0, 0)
    assert measured == StepRecord(1, 5.0, 0.9, 2e-3, 0.1, 1e4, 100.6, ROUTED, 1.5e6, 410.5, 2)
    assert (numpy.dcn_bytes, numpy.dcn_segments, numpy.dcn_window) == (2e3, 3.0, 1)
    assert [type(v) for v in (numpy.dcn_bytes, numpy.dcn_segments, numpy.dcn_window)] == [
        float,
        float,
        int,
    ]
    assert again.steps("j1", since=2) == [numpy]


# A journal from after the MoE routing and before the DCN traffic.
ROUTED_STEPS = """
CREATE TABLE step_metrics (
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    loss REAL, grad_norm REAL, learning_rate REAL,
    step_time_s REAL, tokens_per_s REAL, wall_time REAL,
    experts TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (job_id, step)
);
INSERT INTO step_metrics VALUES ('j1', 0, 5.5, 1.0, 0.001, 0.2, 5000.0, 100.5, '[[0,[1,2],0.5,1.0]]');
"""


@pytest.mark.parametrize("old", [OLD_STEPS, ROUTED_STEPS], ids=["before-moe", "before-dcn"])
def test_a_journal_from_before_dcn_traffic_gains_the_columns(tmp_path, old):
    path = tmp_path / "j.sqlite"
    db = sqlite3.connect(path)
    db.executescript(old)
    db.close()

    journal = Journal(path)
    (first,) = journal.steps("j1")
    assert (first.dcn_bytes, first.dcn_segments, first.dcn_window) == (0, 0, 0)
    assert type(first.dcn_bytes) is float and type(first.dcn_window) is int
    journal.add_steps("j1", [StepRecord(1, 5.0, 0.9, 2e-3, 0.1, 1e4, 100.6, (), 1.5e6, 410.5, 2)])
    journal.close()

    again = Journal(path)  # opening it twice adds nothing twice
    assert [(s.dcn_bytes, s.dcn_window) for s in again.steps("j1")] == [(0, 0), (1.5e6, 2)]
    columns = {
        row[1]: row for row in sqlite3.connect(path).execute("PRAGMA table_info(step_metrics)")
    }
    assert [columns[c][2] for c in ("dcn_bytes", "dcn_segments", "dcn_window")] == [
        "REAL",
        "REAL",
        "INTEGER",
    ]
    assert all(columns[c][3] for c in ("dcn_bytes", "dcn_segments", "dcn_window"))  # NOT NULL
