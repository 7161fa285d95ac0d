"""The jax.distributed coordination service of a gang, run by the controller.

`jax.distributed.initialize` runs the service inside process 0, and every other process
terminates itself the moment it loses the service ("Terminating process because the JAX
distributed service detected fatal errors"). So the death of host 0 would take the
whole gang with it, and with it the replica a surviving slice holds (worker/stash.py).
The controller outlives any worker, so it runs the service for each gang and every
worker, process 0 included, joins it as a client. Process 0 still starts a service of
its own (jax.distributed does not let it skip that); it is bound to a port nobody uses.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any

log = logging.getLogger(__name__)

# A task silent this long is dead to the service, which then ends the others; the
# controller has long torn the gang down by then (see controller/health.py).
HEARTBEAT_TIMEOUT_S = 100


class CoordinationService:
    """One gang's coordination service, listening on `address` until `stop`."""

    def __init__(self, host: str, num_processes: int) -> None:
        from jax._src.lib import _jax

        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        self.address = f"{host}:{port}"
        self._service: Any = _jax.get_distributed_runtime_service(
            self.address,
            num_processes,
            heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
            shutdown_timeout=5,
        )

    def stop(self) -> None:
        """Stops the service (its clients are gone or going: their gang stopped)."""
        service, self._service = self._service, None
        if service is not None:
            with contextlib.suppress(Exception):
                service.shutdown()
