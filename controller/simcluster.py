"""A local Ray cluster whose nodes look like TPU v5e hosts: the embedded simulation.

Each simulated host is a real Ray node (its own raylet) with the resources and labels
that Ray gives a real TPU VM (`ray._private.accelerators.tpu`): `TPU` = chips on the
host, `TPU-<type>-head` on host 0 of each slice, a resource named after the slice, and
the `ray.io/tpu-*` labels. Removing a node is a faithful host failure.

Ray itself authenticates (token authentication, `RAY_AUTH_MODE=token`, Ray 2.52+): the
simulation makes a random token, keeps it in a file only this user can read, and every
Ray process of the cluster, the controller and any tool that attaches as a driver must
present it (`SimulationProcess.ray_env()`); a driver without it is refused by the GCS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slicewise.common.topology import ACCELERATOR_TYPE, SliceType

log = logging.getLogger(__name__)

# Labels Ray sets on TPU nodes (ray._raylet.RAY_NODE_TPU_*_KEY).
SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
TOPOLOGY_LABEL = "ray.io/tpu-topology"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"
ACCELERATOR_LABEL = "ray.io/accelerator-type"
# Ours: marks a node whose "chips" are CPU XLA devices.
SIMULATED_LABEL = "slicewise.io/simulated"

LOOPBACK = "127.0.0.1"


def host_resources(slice_name: str, stype: SliceType, worker_id: int) -> dict[str, float]:
    """The custom Ray resources of one TPU host, as Ray sets them on a real TPU VM."""
    resources = {
        "TPU": float(stype.chips_per_host),
        slice_name: 1.0,
        f"accelerator_type:{ACCELERATOR_TYPE}": 1.0,
    }
    if worker_id == 0:
        resources[stype.head_resource] = 1.0
    return resources


def host_labels(slice_name: str, stype: SliceType, worker_id: int) -> dict[str, str]:
    """The node labels of one TPU host, plus the simulation marker."""
    return {
        SLICE_NAME_LABEL: slice_name,
        WORKER_ID_LABEL: str(worker_id),
        TOPOLOGY_LABEL: stype.topology,
        POD_TYPE_LABEL: stype.name,
        ACCELERATOR_LABEL: ACCELERATOR_TYPE,
        SIMULATED_LABEL: "true",
    }


def ray_auth_env(token_path: str | Path) -> dict[str, str]:
    """Ray's token authentication with the token in `token_path` (a token set in the
    environment would take precedence over the file, so it is cleared)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def slice_names(slices: list[SliceType]) -> list[str]:
    """Stable names for simulated slices: `sim-<index>-<type>`."""
    return [f"sim-{i}-{t.name}" for i, t in enumerate(slices)]


@dataclass
class SimCluster:
    """A running simulated cluster; `shutdown()` stops every process it started."""

    slices: list[SliceType]
    host_object_store_mb: int = 1536
    head_object_store_mb: int = 3072
    _cluster: Any = None
    _hosts: dict[tuple[str, int], Any] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self._cluster.address

    def start(self) -> SimCluster:
        from ray.cluster_utils import Cluster

        started = time.monotonic()
        self._cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "node_ip_address": LOOPBACK,
                "object_store_memory": self.head_object_store_mb * 2**20,
                "include_dashboard": False,
                "include_log_monitor": False,
            },
        )
        try:
            for name, stype in zip(slice_names(self.slices), self.slices, strict=True):
                for worker_id in range(stype.hosts):
                    self.add_host(name, stype, worker_id, wait=False)
            self._cluster.wait_for_nodes(timeout=120)
        except BaseException:
            self.shutdown()
            raise
        log.info(
            "simulated cluster of %d hosts up in %.1f s at %s",
            len(self._hosts),
            time.monotonic() - started,
            self.address,
        )
        return self

    def add_host(
        self, slice_name: str, stype: SliceType, worker_id: int, *, wait: bool = True
    ) -> Any:
        node = self._cluster.add_node(
            wait=wait,
            num_cpus=1,
            node_ip_address=LOOPBACK,
            resources=host_resources(slice_name, stype, worker_id),
            labels=host_labels(slice_name, stype, worker_id),
            object_store_memory=self.host_object_store_mb * 2**20,
            # A log monitor per node tails every worker's log files to forward them to
            # drivers, and the controller takes none (`log_to_driver=False`): it would
            # only poll, on every simulated host, with the hosts' CPU.
            include_log_monitor=False,
        )
        self._hosts[(slice_name, worker_id)] = node
        return node

    def remove_host(self, slice_name: str, worker_id: int) -> None:
        """Kills one simulated host (its raylet and every worker on it)."""
        node = self._hosts.pop((slice_name, worker_id))
        # A TPU VM that goes away takes every process on it at once. Ray's workers would
        # outlive their raylet until they notice it gone (they check once a second), and
        # a job's steps went on meanwhile: 8 steps in one CI run, where 5 are allowed.
        raylets = [p.process.pid for p in node.all_processes.get("raylet", [])]
        on_host = _descendants(raylets)
        for pid in on_host:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._cluster.remove_node(node, allow_graceful=False)

    def restore_host(self, slice_name: str, worker_id: int) -> None:
        """Brings a removed host of a slice back (a new Ray node with its labels), as a
        repaired or replaced TPU VM comes back."""
        names = slice_names(self.slices)
        if slice_name not in names:
            raise ValueError(f"no slice {slice_name!r}; the slices are {names}")
        if (slice_name, worker_id) in self._hosts:
            raise ValueError(f"host {worker_id} of slice {slice_name} is up already")
        stype = self.slices[names.index(slice_name)]
        if not 0 <= worker_id < stype.hosts:
            raise ValueError(f"slice {slice_name} has hosts 0..{stype.hosts - 1}")
        self.add_host(slice_name, stype, worker_id)

    def shutdown(self) -> None:
        if self._cluster is None:
            return
        cluster, self._cluster = self._cluster, None
        for node in list(self._hosts.values()):
            try:
                cluster.remove_node(node, allow_graceful=False)
            except Exception:  # noqa: BLE001 - best effort; the head goes next regardless
                log.exception("removing a simulated host failed")
        self._hosts.clear()
        try:
            cluster.remove_node(cluster.head_node, allow_graceful=False)
        except Exception:  # noqa: BLE001
            log.exception("stopping the simulated head node failed")


# -- the simulation as a process of its own ------------------------------------------
#
# The controller does not start Ray's processes itself: it starts this module as a
# supervisor in a new session, which starts the cluster and stops it again when the
# controller closes the supervisor's stdin, exits, or dies (even by SIGKILL: the pipe
# still closes). On the way out the supervisor kills whatever is left in its session,
# so no raylet, agent or worker outlives the simulation.


def _descendants(roots: list[int]) -> list[int]:
    """Every process below `roots` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _session_processes(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.getsid(int(entry)) == sid:
                pids.append(int(entry))
        except (ProcessLookupError, PermissionError):
            continue
    return pids


def _sweep_session(grace_s: float = 0.5, kill_wait_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, every other process of this session, and waits (at most
    `kill_wait_s`) until they are gone. What is left once the nodes are removed is Ray's
    per-node agents, which hold nothing of ours: some ignore SIGTERM for seconds (the
    grace was 3 s, which every stop then took)."""
    sid = os.getsid(0)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        pids = _session_processes(sid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = _session_processes(sid)
        if not pids:
            return


def _supervise(spec: str, host_store_mb: int, head_store_mb: int) -> int:
    """Runs in the supervisor process: start, report the address, serve commands, stop."""
    from slicewise.common.topology import parse_sim_spec

    os.setsid()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    cluster = SimCluster(parse_sim_spec(spec), host_store_mb, head_store_mb)
    try:
        cluster.start()
        print(json.dumps({"address": cluster.address, "pid": os.getpid()}), flush=True)
        # Commands on stdin (one per line) let tests take hosts away and bring them back;
        # EOF means stop. They run on this thread: starting a Ray node needs the main one.
        commands: queue.SimpleQueue[str] = queue.SimpleQueue()
        reader = threading.Thread(target=_read_lines, args=(commands, stop), daemon=True)
        reader.start()
        while not stop.is_set():
            with contextlib.suppress(queue.Empty):
                print(json.dumps(_run_command(cluster, commands.get(timeout=0.2))), flush=True)
    finally:
        cluster.shutdown()
        _sweep_session()
    return 0


def _read_lines(lines: queue.SimpleQueue[str], stop: threading.Event) -> None:
    for line in sys.stdin:
        if line.strip():
            lines.put(line)
    stop.set()


def _run_command(cluster: SimCluster, line: str) -> dict[str, Any]:
    words = line.split()
    try:
        if words[:1] == ["remove-host"] and len(words) == 3:
            cluster.remove_host(words[1], int(words[2]))
            return {"removed": [words[1], int(words[2])]}
        if words[:1] == ["add-host"] and len(words) == 3:
            cluster.restore_host(words[1], int(words[2]))
            return {"added": [words[1], int(words[2])]}
        return {"error": f"unknown command {line.strip()!r}"}
    except Exception as exc:  # noqa: BLE001 - reported to the caller, keep serving
        return {"error": f"{type(exc).__name__}: {exc}"}


class SimulationProcess:
    """A simulated cluster in a supervisor process of its own (see above)."""

    def __init__(
        self,
        spec: str,
        *,
        host_store_mb: int = 1536,
        head_store_mb: int = 3072,
        start_timeout_s: float = 180.0,
    ) -> None:
        self.spec = spec
        # The Ray token, in a directory of this user's only (mkdtemp makes it 0700).
        self._secrets = tempfile.mkdtemp(prefix="slicewise-ray-")
        self.auth_token_path = Path(self._secrets) / "auth_token"
        fd = os.open(self.auth_token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "controller.simcluster",
                spec,
                "--host-object-store-mb",
                str(host_store_mb),
                "--head-object-store-mb",
                str(head_store_mb),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"} | self.ray_env(),
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin, self._stdout = self._proc.stdin, self._proc.stdout
        line = self._readline(start_timeout_s)
        if not line:
            code = self._proc.wait(timeout=30)
            raise RuntimeError(
                f"the simulated cluster {spec!r} failed to start (exit {code}); "
                "see the messages above"
            )
        info = json.loads(line)
        self.address: str = info["address"]
        self.pid: int = info["pid"]

    def ray_env(self) -> dict[str, str]:
        """The environment a process needs to join this cluster's Ray (as a driver, or
        as a controller started with `--ray-address`)."""
        return ray_auth_env(self.auth_token_path)

    def _readline(self, timeout_s: float) -> str:
        result: list[str] = []
        reader = threading.Thread(
            target=lambda: result.append(self._stdout.readline()), daemon=True
        )
        reader.start()
        reader.join(timeout_s)
        if reader.is_alive():
            self._proc.kill()
            raise TimeoutError(f"the simulated cluster did not start within {timeout_s:.0f} s")
        return result[0]

    def remove_host(self, slice_name: str, worker_id: int, timeout_s: float = 60.0) -> None:
        """Kills one simulated host, as if the TPU VM went away."""
        self._stdin.write(f"remove-host {slice_name} {worker_id}\n")
        self._stdin.flush()
        reply = json.loads(self._readline(timeout_s))
        if "error" in reply:
            raise RuntimeError(reply["error"])

    def add_host(self, slice_name: str, worker_id: int, timeout_s: float = 120.0) -> None:
        """Brings a removed host back, as if its TPU VM was repaired."""
        self._stdin.write(f"add-host {slice_name} {worker_id}\n")
        self._stdin.flush()
        reply = json.loads(self._readline(timeout_s))
        if "error" in reply:
            raise RuntimeError(reply["error"])

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stops the cluster and waits until every one of its processes is gone."""
        if self._proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._stdin.close()
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        shutil.rmtree(self._secrets, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controller.simcluster")
    parser.add_argument("spec")
    parser.add_argument("--host-object-store-mb", type=int, default=1536)
    parser.add_argument("--head-object-store-mb", type=int, default=3072)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # After Ray's import, which sets its logger to INFO: otherwise every controller log
    # and test run began with Ray's "Overwriting previous Ray address" line.
    import ray  # noqa: F401

    logging.getLogger("ray").setLevel(logging.WARNING)
    return _supervise(args.spec, args.host_object_store_mb, args.head_object_store_mb)


if __name__ == "__main__":
    sys.exit(main())
