"""The public testing API without a cluster: the pytest plugin is registered and cheap
to load, its options reach the fixture, and a controller that cannot start says why."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from slicewise.common.errors import InvalidRequestError
from slicewise.testing import ControllerStartError, simulated_cluster


def test_the_plugin_is_registered_for_pytest():
    found = [
        ep for ep in importlib.metadata.entry_points(group="pytest11") if ep.name == "slicewise"
    ]
    assert [ep.value for ep in found] == ["slicewise.pytest_plugin"]


def test_loading_the_plugin_loads_neither_jax_ray_nor_grpc():
    # Every pytest session of a user who installed slicewise loads the plugin.
    code = (
        "import sys, slicewise.pytest_plugin; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('jax', 'jaxlib', 'ray', 'grpc', 'numpy', 'protos', 'controller', 'worker')); "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_bad_spec_fails_before_anything_starts():
    with (
        pytest.raises(InvalidRequestError, match="v5litepod-5"),
        simulated_cluster("2xv5litepod-5"),
    ):
        pytest.fail("the block must not run")


def test_a_controller_that_exits_at_start_shows_its_log():
    # A flag the controller refuses: it exits at once, before Ray or JAX are loaded.
    with (
        pytest.raises(ControllerStartError) as info,
        simulated_cluster(extra_args=("--log-format", "xml")),
    ):
        pytest.fail("the block must not run")
    assert info.value.exit_code == 2
    message = str(info.value)
    assert "exited with code 2" in message
    assert "invalid choice: 'xml'" in message  # the end of the controller's log


def run_pytest(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_fixture_takes_its_cluster_from_the_option_before_the_ini(tmp_path):
    # Unknown slice types fail before any process starts, naming the spec that arrived.
    (tmp_path / "pytest.ini").write_text("[pytest]\nslicewise_sim = 2xv5litepod-5\n")
    (tmp_path / "test_it.py").write_text(
        "def test_cluster(slicewise_client):\n    pass\n\n\ndef test_plain():\n    pass\n"
    )
    from_ini = run_pytest(tmp_path)
    assert "1 passed, 1 error" in from_ini.stdout, from_ini.stdout + from_ini.stderr
    assert "v5litepod-5" in from_ini.stdout
    from_option = run_pytest(tmp_path, "--slicewise-sim", "v5litepod-3")
    assert "1 passed, 1 error" in from_option.stdout, from_option.stdout + from_option.stderr
    assert "v5litepod-3" in from_option.stdout and "v5litepod-5" not in from_option.stdout


def test_the_plugin_can_be_turned_off(tmp_path):
    (tmp_path / "test_it.py").write_text("def test_cluster(slicewise_client):\n    pass\n")
    done = run_pytest(tmp_path, "-p", "no:slicewise")
    assert "fixture 'slicewise_client' not found" in done.stdout, done.stdout + done.stderr
