"""Test-wide settings that must precede any JAX import: a CPU backend with 8 devices,
so that tier-(b) tests can shard over a real (single-process) mesh.

No compilation cache is shared between the suite's controllers: simulated (CPU) workers
compile every program they run (docs/restarts.md says why), as they do for users."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


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
