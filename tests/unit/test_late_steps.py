"""A running job whose step is late says so to its watchers, naming the hosts holding it
up, and again while it stays late; a step that completes ends it (pure: a job runner
without a controller, a gang that only reports its hosts)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from controller import jobs
from controller.health import HostReport
from controller.job import Job, JobSpec, JobState
from controller.jobs import JobRunner
from controller.journal import Journal

A, B = "host 0 of slice sim-0-v5litepod-4", "host 0 of slice sim-1-v5litepod-4"


def test_a_late_step_is_said_with_the_host_behind_and_said_again(tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "STEP_LATE_POLL_S", 0.01)
    monkeypatch.setattr(jobs, "STEP_LATE_S", 0.05)
    monkeypatch.setattr(jobs, "STEP_LATE_EVERY_S", 0.2)
    runner = JobRunner(controller=None, journal=Journal(tmp_path / "journal.sqlite"))
    job = Job("j1", JobSpec(program="lm", num_slices=2, slice_type="v5litepod-4", steps=9))
    for state in (JobState.ADMITTED, JobState.STARTING, JobState.RUNNING):
        job.transition(state)
    job.step = 6
    reports = [HostReport(A, 0.2, 41, "exec", 3.0), HostReport(B, 0.2, 40, "hang", 3.0)]
    gang = SimpleNamespace(state=SimpleNamespace(usable=True), host_reports=lambda: reports)

    async def scenario():
        heard: asyncio.Queue = asyncio.Queue()
        job.watchers.add(heard)
        job.progressed_at = time.monotonic()
        watching = asyncio.ensure_future(runner._say_when_late(job, gang, job.epoch))
        first = await asyncio.wait_for(heard.get(), timeout=30)
        again = await asyncio.wait_for(heard.get(), timeout=30)
        job.transition(JobState.SUCCEEDED)
        await asyncio.wait_for(watching, timeout=30)
        return first["message"], again["message"]

    first, again = asyncio.run(scenario())
    assert first.startswith("waiting on step 7 for ")
    assert first.endswith(f": {B} not done with it (1 other host(s) waiting)")
    assert again.startswith("waiting on step 7 for ")
