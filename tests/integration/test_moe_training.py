"""`slicewise train moe` with its experts split over two simulated slices (`--dcn
expert=2`): the loss curve of a one-device reference run, routing statistics with every
step, shown by the CLI and kept with the job's metrics. (Hierarchical dispatch computes
the same layer as flat: tests/unit/test_moe_sharded.py and
tests/integration/test_moe_sharded.py, across two worker processes.)"""

from __future__ import annotations

import functools
import subprocess

import numpy as np
import pytest

from controller.options import ControllerOptions
from programs.base import get_program, reference_train
from programs.moe.config import SMALL_MOE_OVERRIDES
from protos import controller_pb2 as pb
from tests.integration.test_training import cli, wait_for

pytestmark = pytest.mark.integration

STEPS = 20
STEPS_AHEAD = ControllerOptions().steps_ahead  # how far the workers may be ahead
SMALL = SMALL_MOE_OVERRIDES | {"total_steps": str(STEPS)}


@functools.cache
def reference() -> list[float]:
    program = get_program("moe")
    return reference_train(program, program.make_config(SMALL), STEPS)


def check_routing(steps, config) -> None:
    """Every step carries each MoE layer's routing, consistent with itself."""
    choices = config.k * config.batch_size * config.seq_len
    for s in steps:
        assert [e.layer for e in s.experts] == list(range(config.n_moe_layers)), s
        for e in s.experts:
            assert len(e.tokens_per_expert) == config.n_experts
            assert sum(e.tokens_per_expert) == round((1 - e.dropped_fraction) * choices)
            assert 0.0 <= e.local_fraction <= 1.0


def test_train_moe_over_two_slices_gives_the_reference_loss_curve(client, controller):
    settings = [arg for k, v in SMALL.items() for arg in ("--set", f"{k}={v}")]
    run = subprocess.run(
        cli(
            controller,
            "train",
            "moe",
            "--slices",
            "2",
            "--steps",
            str(STEPS),
            "--dcn",
            "expert=2",
            "--plain",
            *settings,
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    job_id = run.stdout.split()[1].rstrip(":")  # "submitted j4: moe on ..."
    done = client.job(job_id)
    assert [(a.name, a.dcn, a.ici) for a in done.mesh.axes] == [("expert", 2, 1), ("fsdp", 1, 4)]
    steps = client.job_metrics(job_id).steps
    assert [s.step for s in steps] == list(range(STEPS))
    losses = np.array([s.loss for s in steps])
    np.testing.assert_allclose(losses, reference(), rtol=1e-4)
    print(f"largest relative difference: {np.max(np.abs(losses / reference() - 1)):.2e}")
    config = get_program("moe").make_config(SMALL)
    check_routing(steps, config)
    # The experts span both slices, so some choices leave their slice and some stay.
    assert all(0.0 < e.local_fraction < 1.0 for s in steps for e in s.experts)
    # The CLI showed the expert load of the last step.
    assert f"{job_id}   moe0 load " in run.stdout, run.stdout[-1500:]
    # Traffic between slices: predicted from the compiled step, measured every 10 steps
    # from the first step on (its own traffic includes starting up).
    assert done.dcn_predicted and done.dcn_bytes_predicted > 0 and done.dcn_messages_predicted > 0
    measured = [s for s in steps if s.dcn_window]
    assert [s.step for s in measured] == [9, 19], measured
    # Each window counts the steps the workers completed between two readings: all of
    # them after the first step's reading, which at most STEPS_AHEAD steps had passed too.
    covered = sum(s.dcn_window for s in measured)
    assert STEPS - 1 - STEPS_AHEAD <= covered <= STEPS - 1, measured
    assert all(s.dcn_bytes > 0 and s.dcn_segments > 0 for s in measured)
    print(
        f"DCN per step: predicted {done.dcn_bytes_predicted:,.0f} B in "
        f"{done.dcn_messages_predicted} messages; measured "
        + ", ".join(f"{s.dcn_bytes:,.0f} B in {s.dcn_segments:.0f} segments" for s in measured)
    )
    assert f"{job_id}   dcn measured " in run.stdout, run.stdout[-1500:]


PLACED_STEPS = 30
REBALANCE_EVERY = 10


def skewed_corpus(root) -> str:
    """Two files, one per slice's rows (`per_file_rows`): bytes 128-255 for slice 0, whose
    skewed router prefers experts 4-7 (slice 1's), and ASCII text for slice 1, which
    prefers experts 0-3 (slice 0's): most choices cross the DCN until experts move."""
    rng = np.random.default_rng(0)
    (root / "0-high.bin").write_bytes(rng.integers(128, 256, 60_000, np.uint8).tobytes())
    words = rng.choice(["expert", "slice", "token", "route", "the", "of", "a"], 12_000)
    (root / "1-text.txt").write_text(" ".join(words))
    return str(root / "*")


def test_re_placing_skewed_experts_cuts_dcn_bytes_and_changes_no_loss(client, tmp_path):
    """The same skewed job twice on 2 x v5litepod-4 with packed dispatch (DCN bytes follow
    the used slots): once as placed at init, once with the controller re-placing the
    experts before step 10 from the routing of steps 0-9. Same losses; fewer bytes."""
    settings = SMALL | {
        "total_steps": str(PLACED_STEPS),
        "batch_size": "16",
        "seq_len": "64",
        "k": "1",  # Switch routing: each token's one choice follows its byte range
        "dispatch": "packed",
        "dcn_chunk": "16",
        "router_skew": "1",
        "corpus": skewed_corpus(tmp_path),
        "per_file_rows": "true",
    }
    runs = {}
    for every in (0, REBALANCE_EVERY):
        job = client.submit_job(
            "moe",
            slices=2,
            slice_type="v5litepod-4",
            steps=PLACED_STEPS,
            overrides=settings | {"rebalance_every": str(every)},
            dcn={"expert": 2},
            checkpoint_every=0,
        )
        done = wait_for(client, job.job_id, timeout=400)
        assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
        runs[every] = client.job_metrics(job.job_id).steps
    fixed, moved = runs[0], runs[REBALANCE_EVERY]
    assert [s.step for s in moved] == list(range(PLACED_STEPS))

    # What the model computes does not change: same losses, same choices (counted under
    # the experts' new numbers after the move), same drops.
    losses = np.array([[s.loss for s in fixed], [s.loss for s in moved]])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)
    print(
        f"losses re-placed vs as placed: largest relative difference "
        f"{np.max(np.abs(losses[1] / losses[0] - 1)):.2e}"
    )
    for a, b in zip(fixed, moved, strict=True):
        for x, y in zip(a.experts, b.experts, strict=True):
            assert sorted(x.tokens_per_expert) == sorted(y.tokens_per_expert), (a.step, x, y)
            assert x.dropped_fraction == pytest.approx(y.dropped_fraction, abs=1e-6)
    before = [s for s in moved if s.step < REBALANCE_EVERY]
    after = [s for s in moved if s.step >= REBALANCE_EVERY]
    assert all(a.experts == b.experts for a, b in zip(before, fixed, strict=False))
    assert any(
        a.experts[0].tokens_per_expert != b.experts[0].tokens_per_expert
        for a, b in zip(after, fixed[REBALANCE_EVERY:], strict=True)
    )

    # Where it runs does: more choices stay on their slice, and fewer bytes cross.
    def local(steps):
        return float(np.mean([e.local_fraction for s in steps for e in s.experts]))

    fixed_after = fixed[REBALANCE_EVERY:]
    assert local(before) < 0.5 and local(after) > local(fixed_after) + 0.2, (
        local(before),
        local(after),
        local(fixed_after),
    )
    windows = {
        every: {s.step: s.dcn_bytes for s in steps if s.dcn_window} for every, steps in runs.items()
    }
    assert set(windows[0]) == set(windows[REBALANCE_EVERY]) == {9, 19, 29}, windows
    ratios = [windows[REBALANCE_EVERY][s] / windows[0][s] for s in (19, 29)]
    print(
        f"local share after step {REBALANCE_EVERY}: {local(fixed_after):.2f} as placed, "
        f"{local(after):.2f} re-placed; DCN bytes per step (windows 19, 29): "
        f"{[f'{windows[0][s]:,.0f}' for s in (19, 29)]} as placed, "
        f"{[f'{windows[REBALANCE_EVERY][s]:,.0f}' for s in (19, 29)]} re-placed, "
        f"ratios {[f'{r:.2f}' for r in ratios]}"
    )
    # Window 19 also carries the move (the moved experts' weights and Adam moments).
    assert ratios[0] < 1.0 and ratios[1] < 0.85, ratios
