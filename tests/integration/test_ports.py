"""A second controller on a port the first one listens on fails at once, saying so, and
the first goes on serving (issue: two controllers on one port split its connections)."""

from __future__ import annotations

import subprocess
import sys
from urllib.parse import urlparse

import pytest

import slicewise

pytestmark = pytest.mark.integration

# The refusal comes before a simulation or Ray starts: well within this, which is only
# the bound on a test that would otherwise wait for a second controller to come up.
REFUSAL_TIMEOUT_S = 120


def second_controller(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "controller.cli",
            "controller",
            "--sim",
            "1xv5litepod-4",
            "--insecure-local",
            "--state-dir",
            str(tmp_path / "state"),
            *args,
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=REFUSAL_TIMEOUT_S,
    )


def test_a_second_controller_on_the_same_port_is_refused(controller, tmp_path):
    port = controller.address.rsplit(":", 1)[1]
    second = second_controller(tmp_path, "--port", port)
    assert second.returncode != 0
    assert f"port {port} on 127.0.0.1 is in use" in second.stderr
    assert "listening on" not in second.stdout
    with slicewise.connect(controller.address, name="ports") as client:
        assert client.cluster_info().slices  # the first one still answers


def test_a_metrics_port_in_use_is_refused(controller, tmp_path):
    port = str(urlparse(controller.metrics_url).port)
    second = second_controller(tmp_path, "--port", "0", "--metrics-port", port)
    assert second.returncode != 0
    assert f"port {port} on 127.0.0.1 is in use" in second.stderr
    assert "--metrics-port" in second.stderr
