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
from tests.integration.test_training import cli

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
