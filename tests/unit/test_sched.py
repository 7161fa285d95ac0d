"""worker/sched.py: a simulated host's dispatch threads go after its devices."""

import os
import threading

import pytest

from worker import sched

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux only")


def policy_on_new_thread(monkeypatch, value):
    """The policy a new thread has after `dispatch_thread`, with the variable at `value`."""
    if value is None:
        monkeypatch.delenv(sched.SCHEDULING_ENV, raising=False)
    else:
        monkeypatch.setenv(sched.SCHEDULING_ENV, value)
    seen = []

    def run():
        done = sched.dispatch_thread()
        seen.append((done, os.sched_getscheduler(threading.get_native_id())))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=10)
    return seen[0]


def test_a_simulated_hosts_dispatch_thread_runs_under_sched_idle(monkeypatch):
    assert policy_on_new_thread(monkeypatch, "idle") == (True, os.SCHED_IDLE)


@pytest.mark.parametrize("value", [None, "", "normal"])
def test_any_other_host_keeps_the_default_policy(monkeypatch, value):
    assert policy_on_new_thread(monkeypatch, value) == (False, os.SCHED_OTHER)


def test_only_the_calling_thread_changes(monkeypatch):
    before = os.sched_getscheduler(threading.get_native_id())
    assert policy_on_new_thread(monkeypatch, "idle") == (True, os.SCHED_IDLE)
    assert os.sched_getscheduler(threading.get_native_id()) == before
