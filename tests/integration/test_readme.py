"""The README's client script runs as written against a controller."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_client_script() -> str:
    text = README.read_text()
    match = re.search(r"<!-- readme-client[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert match, "README.md has no client block marked readme-client"
    return match.group(1)


def test_readme_client_block_is_about_twenty_lines():
    lines = [ln for ln in readme_client_script().splitlines() if ln.strip()]
    assert len(lines) <= 25, len(lines)


def test_readme_client_script_runs_as_written(controller, tmp_path):
    script = readme_client_script()
    assert '"127.0.0.1:50051"' in script
    path = tmp_path / "client.py"
    path.write_text(script.replace("127.0.0.1:50051", controller.address))
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in done.stdout.splitlines() if r.strip()]
    assert len(rows) == 8 and all(r.strip("[] ").split() == ["64."] * 8 for r in rows), done.stdout
