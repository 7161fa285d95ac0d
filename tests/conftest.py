"""Test-wide settings that must precede any JAX import: a CPU backend with 8 devices,
so that tier-(b) tests can shard over a real (single-process) mesh.

Every controller a test starts keeps its workers' compiled programs in one directory
for the session (all xdist workers of a run together, removed at its end), as the
controllers of one deployment would: a program the suite has compiled once (the test
LM's step on two slices, say) loads in a fraction of a second in every later module
instead of compiling again. Each module's first job may so load what another compiled;
test_restarts runs a program again on the same hosts in any case."""

import os
import shutil
import tempfile
from pathlib import Path

from controller.cli import COMPILATION_CACHE_ENV

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# Set here, in the run's main process, before xdist starts its workers (which inherit
# it); the main process removes it at the end, after every worker has finished.
_OWN_CACHE = COMPILATION_CACHE_ENV not in os.environ
_CACHE = Path(tempfile.gettempdir()) / f"slicewise-test-compilation-cache-{os.getpid()}"


def pytest_configure(config):
    if _OWN_CACHE:
        os.environ[COMPILATION_CACHE_ENV] = str(_CACHE)


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(_CACHE, ignore_errors=True)


# Seconds spent per test file (setup, call and teardown of its tests, fixtures included),
# summed in the main process from every xdist worker's reports: the end of the run names
# the slowest files, which is where the suite's 20 minutes go.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.partition("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    terminalreporter.section("slowest test files")
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_line(f"{total:8.1f}s in all, {len(_FILE_SECONDS)} files")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:20]:
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
