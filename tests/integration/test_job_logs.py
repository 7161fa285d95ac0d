"""`slicewise logs JOB` on a real controller: the controller's lines about the job, the
stderr tails of its workers while it runs, and with -f the new lines until it ends."""

from __future__ import annotations

import subprocess
import sys

import pytest

from controller.jobview import TERMINAL
from slicewise.testing import wait_until
from tests.integration.conftest import controller_log
from tests.integration.test_checkpoints import finished, submit_lm

pytestmark = pytest.mark.integration


def cli(controller, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controller.cli", *args, "--controller", controller.address],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_logs_of_a_running_job_show_the_controller_and_every_worker(controller, client):
    job = submit_lm(client, 400, checkpoint_every=0)
    try:
        wait_until(
            lambda: client.job(job.job_id).step >= 2,
            timeout_s=300,
            interval_s=0.2,
            what=f"job {job.job_id} to train",
        )
        lines = list(client.job_logs(job.job_id, tail=50))
    finally:
        client.cancel_job(job.job_id)
    sources = [line.source for line in lines]
    assert sources[0] == "controller"
    text = "\n".join(line.text for line in lines if line.source == "controller")
    assert f"job {job.job_id} submitted" in text and "running: mesh" in text
    hosts = [s for s in dict.fromkeys(sources) if s != "controller"]
    assert len(hosts) == 2 and all(h.startswith("host 0 of slice ") for h in hosts)
    for host in hosts:  # each worker's stderr says it joined its gang
        assert any("joined" in line.text for line in lines if line.source == host)


def test_logs_follow_until_the_job_ends(controller, client):
    job = submit_lm(client, 6, checkpoint_every=0)
    followed = cli(controller, "logs", job.job_id, "-f")
    info = client.job(job.job_id)
    assert info.state in TERMINAL  # -f returned: the job had ended
    assert followed.returncode == 0, followed.stderr
    assert f"job {job.job_id} succeeded" in followed.stdout
    finished(client, job.job_id)


def test_logs_of_an_unknown_job_say_so(controller):
    result = cli(controller, "logs", "j999-nosuchjob")
    assert result.returncode == 1
    assert "unknown to this controller" in result.stderr


def test_logs_refuse_a_tail_below_one(controller):
    result = cli(controller, "logs", "j1", "--tail", "0")
    assert result.returncode == 2 and "--tail must be at least 1" in result.stderr


def test_the_controllers_log_has_no_ray_address_notice(controller):
    """Every controller log began with Ray's 'Overwriting previous Ray address' line."""
    assert "Overwriting previous Ray address" not in controller_log(controller)
