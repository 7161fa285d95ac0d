"""Where a controller keeps its state when not told, the lock that keeps two controllers
off one state directory (no processes: the lock is per open file), and the per-step MoE
routing its journal keeps there (also in journals written before it was kept)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import numpy as np

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
    ExpertLoad(0, (12, 30, 7, 0), 0.021, 0.63),
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
    assert raw.fetchone()[0] == "[[0,[12,30,7,0],0.021,0.63],[1,[10,10,10,10],0.0,1.0]]"


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
