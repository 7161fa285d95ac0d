"""The gang's health judgement (controller/health.py), the step deadline a job sets, and
the checks on a fault injection request (controller/chaos.py): pure logic."""

from __future__ import annotations

import random

import pytest

from controller.chaos import plan_fault
from controller.health import LAG_FLOOR_S, HostReport, diagnose, lag_deadline
from controller.jobs import step_deadline
from slicewise.common.errors import FailedPreconditionError, InvalidRequestError

A, B, C = (f"host 0 of slice sim-{i}-v5litepod-4" for i in range(3))


def judge(*hosts: HostReport, deadline: float | None = 8.0, lag: float | None = None) -> str | None:
    return diagnose(hosts, heartbeat_timeout_s=10.0, step_deadline_s=deadline, lag_deadline_s=lag)


def test_hosts_that_answer_and_move_are_healthy():
    assert judge(HostReport(A, 0.4, 12, "exec", 0.2), HostReport(B, 0.1)) is None


def test_a_silent_host_stopped_answering_and_is_named():
    reason = judge(HostReport(A, 0.3), HostReport(B, 10.5, 7, "exec", 0.1))
    assert reason is not None
    assert reason.startswith(f"{B} stopped answering: nothing heard from its worker for 10.5 s")
    assert "--heartbeat-timeout" in reason


def test_the_quietest_of_several_silent_hosts_is_named_with_a_count():
    reason = judge(HostReport(A, 11.0), HostReport(B, 30.0), HostReport(C, 12.0))
    assert reason is not None and reason.startswith(f"{B} (and 2 more) stopped answering")


def test_a_host_behind_the_others_is_named_as_where_the_collective_is_stuck():
    reason = judge(
        HostReport(A, 0.2, 101, "exec", 8.1),
        HostReport(B, 0.3, 97, "hang", 9.0),
        HostReport(C, 0.1, 101, "exec", 8.2),
    )
    assert reason == (
        f"a collective is stuck on {B}: stuck at op 97 (hang) for 9.0 s while 2 other "
        "host(s) wait in op 101 (exec) (limit 8.0 s, --step-timeout)"
    )


def test_a_collective_every_host_waits_in_is_reported_as_never_completing():
    reason = judge(HostReport(A, 0.2, 40, "exec", 8.5), HostReport(B, 0.2, 40, "exec", 9.5))
    assert reason is not None
    assert reason.startswith("op 40 (exec) has not completed on any of the 2 host(s)")
    assert "for 9.5 s" in reason


@pytest.mark.parametrize(
    ("hosts", "deadline"),
    [
        # Stalled, but not past the deadline.
        ((HostReport(A, 0.2, 40, "exec", 7.9), HostReport(B, 0.2, 41, "exec", 7.5)), 8.0),
        # No deadline: a client's gang, whose programs may run as long as they like.
        ((HostReport(A, 0.2, 40, "exec", 900.0), HostReport(B, 0.2, 40, "exec", 900.0)), None),
        # One host compiles the program the other waits to run.
        ((HostReport(A, 0.2, 40, "exec", 30.0), HostReport(B, 0.2, 40, "exec", 30.0, "step")), 8.0),
        # Restoring a checkpoint may take long.
        ((HostReport(A, 0.2, 3, "restore", 60.0), HostReport(B, 0.2, 3, "restore", 59.0)), 8.0),
    ],
)
def test_stalls_that_are_not_stuck_collectives(hosts, deadline):
    assert judge(*hosts, deadline=deadline) is None


def test_a_host_a_step_behind_its_waiting_peers_fails_the_gang_at_the_lag_deadline():
    reason = judge(
        HostReport(A, 0.2, 98, "exec", 3.4),
        HostReport(B, 0.3, 97, "hang", 3.6),
        HostReport(C, 0.1, 98, "exec", 3.3),
        deadline=20.0,
        lag=3.0,
    )
    assert reason == (
        f"a collective is stuck on {B}: stuck at op 97 (hang) for 3.6 s while 2 other "
        "host(s) wait in op 98 (exec) (limit 3.0 s for a host behind its peers: 3x the "
        f"slowest step, at least {LAG_FLOOR_S:g} s)"
    )


@pytest.mark.parametrize(
    "hosts",
    [
        # Every host in the same step: a slow step, for the step deadline to judge.
        (HostReport(A, 0.2, 40, "exec", 9.0), HostReport(B, 0.2, 40, "exec", 9.0)),
        # The peers have only just moved on (they have not waited past the deadline).
        (HostReport(A, 0.2, 41, "exec", 0.4), HostReport(B, 0.2, 40, "exec", 9.0)),
        # Behind on a checkpoint save, which may rightly take long.
        (HostReport(A, 0.2, 41, "exec", 9.0), HostReport(B, 0.2, 40, "save", 9.0)),
        # A host compiles: the others wait for it in the program's first collective.
        (HostReport(A, 0.2, 41, "exec", 9.0), HostReport(B, 0.2, 40, "exec", 9.0, "step")),
    ],
)
def test_what_the_lag_deadline_leaves_alone(hosts):
    assert judge(*hosts, deadline=20.0, lag=3.0) is None


def test_without_a_lag_deadline_a_host_behind_waits_for_the_step_deadline():
    behind = (HostReport(A, 0.2, 41, "exec", 9.0), HostReport(B, 0.2, 40, "hang", 9.0))
    assert judge(*behind, deadline=20.0) is None
    assert judge(*behind, deadline=20.0, lag=3.0) is not None


def test_the_lag_deadline_is_three_slowest_steps_and_never_below_its_floor():
    assert lag_deadline(0.2) == LAG_FLOOR_S
    assert lag_deadline(2.0) == 6.0


def test_a_silent_host_is_judged_even_without_a_deadline():
    assert judge(HostReport(A, 12.0), deadline=None) is not None


def test_the_step_deadline_is_ten_slowest_steps_and_never_below_the_floor():
    assert step_deadline(20.0, 0.05) == 20.0
    assert step_deadline(20.0, 3.0) == 30.0
    assert step_deadline(5.0, 0.0) == 5.0


def plan(kind="kill-worker", **kwargs):
    args = dict(
        at_step=12,
        process=1,
        num_processes=2,
        step=3,
        steps=40,
        simulated=True,
        allowed=True,
    )
    return plan_fault(kind, **(args | kwargs))


def test_a_fault_plan_keeps_what_was_asked():
    fault = plan("hang-collective", at_step=12, process=1)
    assert (fault.kind, fault.at_step, fault.process, fault.fired_at) == (
        "hang-collective",
        12,
        1,
        0.0,
    )
    assert plan(at_step=None).at_step == 0  # now


def test_a_fault_without_a_host_hits_one_at_random_within_the_gang():
    picked = {
        plan(process=None, num_processes=4, rng=random.Random(seed)).process for seed in range(40)
    }
    assert picked == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"allowed": False}, FailedPreconditionError, "--allow-chaos"),
        ({"kind": "explode"}, InvalidRequestError, "unknown fault 'explode'"),
        ({"kind": "remove-host", "simulated": False}, FailedPreconditionError, "--sim"),
        ({"process": 2}, InvalidRequestError, r"processes 0\.\.1"),
        ({"process": -1}, InvalidRequestError, "not in the job's gang"),
        ({"at_step": 3}, InvalidRequestError, r"after the job's current step \(3\)"),
        ({"at_step": 40}, InvalidRequestError, r"before its last \(40\)"),
    ],
)
def test_a_fault_request_that_cannot_be_done_says_why(kwargs, error, words):
    kind = kwargs.pop("kind", "kill-worker")
    with pytest.raises(error, match=words):
        plan(kind, **kwargs)


def test_holding_up_names_the_hosts_behind_or_compiling():
    from controller.health import holding_up

    assert (
        holding_up([HostReport(A, 0.2, 40, "exec", 5.0), HostReport(B, 0.2, 40, "exec", 5.0)]) == ""
    )
    assert holding_up([HostReport(A, 0.2), HostReport(B, 0.2)]) == ""
    behind = holding_up([HostReport(A, 0.2, 41, "exec", 5.0), HostReport(B, 0.2, 40, "hang", 5.0)])
    assert behind == f"{B} not done with it (1 other host(s) waiting)"
    compiling = holding_up(
        [HostReport(A, 0.2, 40, "exec", 5.0), HostReport(B, 0.2, 40, "exec", 5.0, "lm.step")]
    )
    assert compiling == f"{B} compiling lm.step"
