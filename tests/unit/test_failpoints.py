"""slicewise/common/failpoints.py: a test's failpoints file is read on every use, and
the controller hands it to every worker it starts (on a fake cluster, no processes)."""

from __future__ import annotations

import asyncio
import json

import pytest

from controller.admission import GangManager
from controller.options import ControllerOptions
from slicewise.common.failpoints import ENV_VAR, failpoint, worker_env
from tests.unit.fake_cluster import Clock, FakeCluster


def test_a_failpoint_is_read_from_the_file_on_every_use(tmp_path, monkeypatch):
    path = tmp_path / "failpoints.json"
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert failpoint("save_commit_delay_s") == 0.0 and worker_env() == {}
    monkeypatch.setenv(ENV_VAR, str(path))
    assert failpoint("save_commit_delay_s") == 0.0  # no file yet
    path.write_text(json.dumps({"save_commit_delay_s": 600}))
    assert failpoint("save_commit_delay_s") == 600.0
    assert failpoint("reserve_delay_s") == 0.0
    path.write_text("{}")
    assert failpoint("save_commit_delay_s") == 0.0
    assert worker_env() == {ENV_VAR: str(path)}


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", '{"save_commit_delay_s": [1]}'])
def test_an_unreadable_failpoints_file_sets_nothing(tmp_path, monkeypatch, text):
    path = tmp_path / "failpoints.json"
    path.write_text(text)
    monkeypatch.setenv(ENV_VAR, str(path))
    assert failpoint("save_commit_delay_s") == 0.0


@pytest.mark.parametrize("set_env", [True, False])
def test_the_failpoints_file_reaches_every_worker_of_a_gang(tmp_path, monkeypatch, set_env):
    path = tmp_path / "failpoints.json"
    if set_env:
        monkeypatch.setenv(ENV_VAR, str(path))
    else:
        monkeypatch.delenv(ENV_VAR, raising=False)

    async def scenario():
        cluster = FakeCluster("v5litepod-16", "v5litepod-16")
        manager = GangManager(cluster, clock=Clock(), options=ControllerOptions())
        await manager.refresh_inventory()
        await manager.allocate(2, "v5litepod-16")
        return cluster

    cluster = asyncio.run(asyncio.wait_for(scenario(), 10.0))
    assert len(cluster.workers) == 8
    want = str(path) if set_env else None
    assert [w.spec.env.get(ENV_VAR) for w in cluster.workers] == [want] * 8
