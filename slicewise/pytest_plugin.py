"""The slicewise pytest plugin: one controller on a simulated cluster per test session.

Installed with slicewise and loaded by pytest through the `pytest11` entry point. A test
that asks for the fixture `slicewise_client` gets a `slicewise.Client` connected to a
controller on a simulated cluster; the first such test starts the cluster, every later
one shares it, and it stops when the session ends. A session whose tests never ask for
it starts nothing: this module imports none of JAX, Ray or gRPC.

    --slicewise-sim SPEC   (ini: slicewise_sim)   the cluster, default 2xv5litepod-4
    -p no:slicewise                               turns the plugin off
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from slicewise.testing import DEFAULT_SIM, log_tail, simulated_cluster

if TYPE_CHECKING:
    from slicewise.client import Client

FIXTURE = "slicewise_client"
_LOG = pytest.StashKey[Path]()


def pytest_addoption(parser: pytest.Parser) -> None:
    help_text = (
        f"the simulated cluster of the {FIXTURE} fixture, as for `slicewise controller "
        f"--sim` (default {DEFAULT_SIM})"
    )
    group = parser.getgroup("slicewise", "slicewise simulated cluster")
    group.addoption("--slicewise-sim", dest="slicewise_sim", metavar="SPEC", help=help_text)
    parser.addini("slicewise_sim", help=help_text, default=DEFAULT_SIM)


@pytest.fixture(scope="session")
def slicewise_client(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Client]:
    """A client of a controller on a simulated cluster shared by the whole session."""
    config = request.config
    sim = config.getoption("slicewise_sim") or config.getini("slicewise_sim")
    log = tmp_path_factory.mktemp("slicewise") / "controller.log"
    config.stash[_LOG] = log
    with simulated_cluster(sim, name=f"pytest-{os.getpid()}", log=log) as client:
        yield client


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """A failing test that used the cluster shows the end of the controller's log."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and FIXTURE in getattr(item, "fixturenames", ()):
        log = item.config.stash.get(_LOG, None)
        if log is not None and log.exists():
            report.sections.append((f"slicewise controller log {log} (tail)", log_tail(log)))
