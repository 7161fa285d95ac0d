"""The README's examples run as written: the client script against a controller, and the
example test file under pytest with the installed slicewise plugin."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(marker: str) -> str:
    """The ```python block that follows `<!-- MARKER ... -->` in README.md."""
    text = README.read_text()
    match = re.search(rf"<!-- {marker}[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert match, f"README.md has no python block marked {marker}"
    return match.group(1)


def readme_client_script() -> str:
    return readme_block("readme-client")


def test_readme_client_block_is_about_twenty_lines():
    lines = [ln for ln in readme_client_script().splitlines() if ln.strip()]
    assert len(lines) <= 25, len(lines)


# Before the test that starts the suite's shared controller: one cluster at a time.
@pytest.mark.timeout(900)
def test_readme_example_test_passes_under_pytest_with_the_installed_plugin(tmp_path):
    # As a user runs it: a fresh pytest in a directory of its own (no conftest of ours),
    # the plugin found through its entry point, and none of this suite's JAX settings.
    source = readme_block("readme-pytest")
    tests = len(re.findall(r"^def test_", source, re.M))
    assert tests >= 1 and "slicewise_client" in source
    (tmp_path / "test_example.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_example.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        try:
            out, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            # Ctrl-C, not a kill: pytest then tears the session fixture down, which
            # stops the simulated cluster.
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=180)
            pytest.fail(f"the README's example test did not finish in 600 s:\n{out[-5000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, out[-5000:]
    assert f"{tests} passed" in out, out[-3000:]


def test_readme_client_script_runs_as_written(controller, tmp_path):
    script = readme_client_script()
    assert '"127.0.0.1:50051"' in script
    path = tmp_path / "client.py"
    path.write_text(script.replace("127.0.0.1:50051", controller.address))
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in done.stdout.splitlines() if r.strip()]
    assert len(rows) == 8 and all(r.strip("[] ").split() == ["64."] * 8 for r in rows), done.stdout
