"""The Ray actor that runs on each TPU host (or simulated host) of a gang.

A worker lives as long as its gang: it joins the gang's jax.distributed cluster once
(JAX allows that once per process) and is killed when the gang is released.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from controller.mesh import GangShape
from worker.executor import InOrderExecutor
from worker.ops import Op, OpResult
from worker.runtime import JaxRuntime
from worker.transport import DataServer

log = logging.getLogger(__name__)

# How many programs may be launched and not yet finished on one host (see executor.py).
DEFAULT_WINDOW = 3


class HostWorker:
    """One host of a gang. Created by the controller with `ray.remote(HostWorker)`."""

    def __init__(self, gang_id: str, gang: GangShape, process_id: int, *,
                 window: int = DEFAULT_WINDOW) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        self.gang_id = gang_id
        self.process_id = process_id
        self.runtime = JaxRuntime(gang, process_id)
        self.executor = InOrderExecutor(
            self.runtime.apply, window=window, on_failure=self.runtime.on_failure
        )
        self._epoch = 0
        self._started = time.time()
        import ray

        self.data = DataServer(ray.util.get_node_ip_address(), self.runtime.stage,
                               self.runtime.read_pinned)

    def data_address(self) -> str:
        """Where the controller sends and fetches array bytes (see worker/transport.py)."""
        return self.data.address

    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "gang": self.gang_id, "process_id": self.process_id}

    def free_address(self, host: str) -> str:
        """An address on this host with a free port, for the jax.distributed coordinator."""
        with socket.socket() as s:
            s.bind((host, 0))
            return f"{host}:{s.getsockname()[1]}"

    def initialize(self, coordinator: str, epoch: int, *, partition_index: int,
                   bind_address: str | None, timeout_s: int) -> dict[str, Any]:
        info = self.runtime.initialize(
            coordinator, partition_index=partition_index, bind_address=bind_address,
            timeout_s=timeout_s,
        )
        self._epoch = epoch
        log.info("gang %s process %d joined: %s", self.gang_id, self.process_id, info)
        return info | {"pid": os.getpid()}

    def run(self, epoch: int, ops: list[Op]) -> list[OpResult]:
        """Applies `ops` in sequence order; returns when all of them have completed."""
        if epoch != self._epoch:
            return [OpResult(op.seq, f"stale epoch {epoch} (worker is at {self._epoch})")
                    for op in ops]
        return self.executor.run(ops)

    def drop_pin(self, pin_id: str) -> None:
        self.runtime.drop_pin(pin_id)

    def stats(self) -> dict[str, Any]:
        return self.runtime.stats() | {
            "process_id": self.process_id,
            "pid": os.getpid(),
            "next_seq": self.executor.next_seq,
            "max_in_flight": self.executor.max_in_flight,
            "window": self.executor.window,
            "uptime_s": time.time() - self._started,
        }
