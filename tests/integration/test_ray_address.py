"""`slicewise controller --ray-address`: join a Ray cluster someone else started.

The cluster here is a separately started simulated one (`slicewise cluster --sim`), whose
nodes carry the same TPU resources and labels as real TPU VMs; the controller finds the
slices from those labels alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import slicewise
from controller.simcluster import ray_auth_env
from programs.demo import dcn_sum_matmul, dcn_sum_matmul_reference
from slicewise.launch import stop_process
from slicewise.testing import wait_until
from tests.integration.conftest import start_controller
from tests.integration.test_shutdown import _alive

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def external_cluster():
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", "cluster", "--sim", "2xv5litepod-1"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        lines: list[str] = []

        def read():
            # To the end, so that the cluster never blocks on a full pipe; in a thread, so
            # that the wait below can time out.
            for line in proc.stdout:
                lines.append(line)

        threading.Thread(target=read, daemon=True).start()

        def printed(what):
            found = [ln.rsplit(" ", 1)[1].strip() for ln in list(lines) if what in ln]
            assert found or proc.poll() is None, f"the cluster exited with {proc.returncode}"
            return found[0] if found else None

        address = wait_until(
            lambda: printed("Ray address"), timeout_s=180, what="the cluster to print its address"
        )
        token_path = wait_until(
            lambda: printed("Ray authentication token in"),
            timeout_s=30,
            what="the cluster to say where its Ray token is",
        )
        yield proc, address, token_path
    finally:
        assert stop_process(proc) == 0


def test_controller_joins_an_existing_cluster_and_leaves_it_running(
    tmp_path_factory, external_cluster
):
    cluster_proc, address, token_path = external_cluster
    # Started from a directory whose modules share our package names: neither the
    # controller nor its Ray workers may import them.
    decoys = tmp_path_factory.mktemp("decoys")
    for name in ("worker", "controller", "programs"):
        (decoys / f"{name}.py").write_text(f"raise ImportError('decoy {name}.py was imported')\n")
    controller = start_controller(
        tmp_path_factory,
        "ray-address",
        ray_address=address,
        cwd=str(decoys),
        env=ray_auth_env(token_path),
    )
    try:
        with slicewise.connect(controller.address) as client:
            health = client.health()
            assert health.simulation_pid == 0  # it started no simulation of its own
            assert health.ray_auth_token_path == token_path  # the cluster's, as told
            info = client.cluster_info()
            assert sorted(s.slice_type for s in info.slices) == ["v5litepod-1"] * 2
            with client.allocate(slices=2, slice_type="v5litepod-1", timeout=120) as gang:
                mesh = gang.mesh(dcn={"slice": 2}, ici={"data": 1, "model": 1})
                x = np.arange(24, dtype=np.float32).reshape(4, 6)
                w = np.ones((6, 2), np.float32)
                xr = gang.put(x, mesh.sharding(("slice", "data"), None))
                wr = gang.put(w, mesh.sharding(None, "model"))
                z = gang.compile(dcn_sum_matmul(mesh.abstract), xr, wr)(xr, wr).fetch()
                np.testing.assert_allclose(z, dcn_sum_matmul_reference(x, w, 2), rtol=1e-6)
                worker_pids = [w.pid for w in gang.stats().workers]
            # A gang still held when the controller stops must not outlive it either.
            held = client.allocate(slices=1, slice_type="v5litepod-1", timeout=120)
            worker_pids += [w.pid for w in held.stats().workers]
        assert controller.stop() == 0
        wait_until(
            lambda: not any(_alive(p) for p in worker_pids),
            timeout_s=60,
            interval_s=0.5,
            what=f"the workers {worker_pids} to exit with their controller",
        )
        assert cluster_proc.poll() is None, "stopping the controller stopped the Ray cluster"
    finally:
        controller.stop()


@pytest.mark.parametrize(
    "auth", [{"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}, {"RAY_AUTH_MODE": "disabled"}]
)
def test_a_ray_driver_without_the_clusters_token_is_refused(external_cluster, auth):
    _, address, token_path = external_cluster
    assert oct(os.stat(token_path).st_mode & 0o777) == "0o600"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    driver = subprocess.Popen(
        [sys.executable, "-c", "import ray, sys; ray.init(address=sys.argv[1])", address],
        env=env | auth | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        said: list[str] = []
        threading.Thread(target=lambda: said.extend(driver.stderr), daemon=True).start()
        wait_until(
            lambda: any("Authentication token is missing or incorrect" in ln for ln in said),
            timeout_s=120,
            what="Ray's GCS to refuse the driver",
        )
    finally:
        stop_process(driver)
