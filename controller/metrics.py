"""Prometheus metrics of the controller (served with `--metrics-port`).

Defined once per process on the default registry; the controller updates them where
things happen, and `serve_metrics` exposes them over HTTP for Prometheus to scrape.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)

QUEUE_LENGTH = Gauge("slicewise_queue_length", "Gang requests waiting for admission")
GANGS = Gauge("slicewise_gangs", "Gangs currently holding slices")
SLICES = Gauge("slicewise_slices", "TPU slices in the inventory", ["state"])
RPC_SECONDS = Histogram(
    "slicewise_rpc_seconds",
    "Time the controller spent answering an RPC",
    ["method"],
    buckets=_LATENCY_BUCKETS,
)
STREAM_CALLS = Counter("slicewise_stream_calls_total", "Calls received on call streams")
STREAM_MESSAGES = Counter(
    "slicewise_stream_messages_total", "Call-stream messages received (calls travel together)"
)
BYTES = Counter("slicewise_bytes_total", "Array bytes moved through the controller", ["direction"])
FAILURES = Counter("slicewise_failures_total", "Failed RPCs, operations and workers", ["kind"])
TRANSFER_BYTES = Gauge(
    "slicewise_transfer_bytes",
    "Bytes the controller holds for client transfers under way: puts being received, "
    "fetches being sent, programs being uploaded (0 when none is)",
    ["kind"],
)
STEP_SECONDS = Histogram(
    "slicewise_step_seconds",
    "Training step time of jobs, as their workers measured it (the slowest host's)",
    buckets=_LATENCY_BUCKETS,
)
STEPS = Counter("slicewise_steps_total", "Training steps completed by jobs")


class OpTally:
    """One kind of operation's count and dispatch latencies (see `OperationMetrics`)."""

    __slots__ = ("buckets", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.buckets = [0] * (len(_LATENCY_BUCKETS) + 1)  # the last one: above them all

    def observe(self, seconds: float) -> None:
        """One operation settled, `seconds` after it was queued (the event loop's thread
        only: the scrape reads these unlocked)."""
        self.seconds += seconds
        self.buckets[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1


class OperationMetrics(Collector):
    """`slicewise_operations_total` and `slicewise_dispatch_latency_seconds` by kind of
    operation, counted in plain Python and made into metrics only when Prometheus
    scrapes: they change with every operation of every call, and prometheus_client's
    Counter.inc and Histogram.observe take a lock each, 2.6 us a call together against
    0.4 for `OpTally.observe` (timeit, 2026-12-04), on the controller's one thread."""

    def __init__(self) -> None:
        self._tallies: dict[str, OpTally] = {}

    def tally(self, kind: str) -> OpTally:
        tally = self._tallies.get(kind)
        if tally is None:
            tally = self._tallies[kind] = OpTally()
        return tally

    def collect(self) -> Iterator[Metric]:
        operations = CounterMetricFamily(
            "slicewise_operations", "Operations dispatched to gangs", labels=["kind"]
        )
        latency = HistogramMetricFamily(
            "slicewise_dispatch_latency_seconds",
            "From an operation being queued on a gang to every worker having completed it",
            labels=["kind"],
        )
        for kind, tally in list(self._tallies.items()):
            counts = list(tally.buckets)  # one copy: the count is their sum, never behind
            cumulative, buckets = 0, []
            for bound, n in zip((*_LATENCY_BUCKETS, math.inf), counts, strict=True):
                cumulative += n
                buckets.append((_bound_label(bound), float(cumulative)))
            operations.add_metric([kind], float(cumulative))
            latency.add_metric([kind], buckets, sum_value=tally.seconds)
        yield operations
        yield latency


def _bound_label(bound: float) -> str:
    """A bucket's `le` as prometheus_client writes it (0.5, 1.0, +Inf)."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))


OPERATIONS = OperationMetrics()
REGISTRY.register(OPERATIONS)


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Starts the /metrics HTTP endpoint; returns the port it listens on."""
    server, _ = start_http_server(port, addr=host)
    return server.server_port
