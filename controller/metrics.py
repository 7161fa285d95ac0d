"""Prometheus metrics of the controller (served with `--metrics-port`).

Defined once per process on the default registry; the controller updates them where
things happen, and `serve_metrics` exposes them over HTTP for Prometheus to scrape.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

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
DISPATCH_SECONDS = Histogram(
    "slicewise_dispatch_latency_seconds",
    "From an operation being queued on a gang to every worker having completed it",
    ["kind"],
    buckets=_LATENCY_BUCKETS,
)
RPC_SECONDS = Histogram(
    "slicewise_rpc_seconds",
    "Time the controller spent answering an RPC",
    ["method"],
    buckets=_LATENCY_BUCKETS,
)
OPERATIONS = Counter("slicewise_operations_total", "Operations dispatched to gangs", ["kind"])
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


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Starts the /metrics HTTP endpoint; returns the port it listens on."""
    server, _ = start_http_server(port, addr=host)
    return server.server_port
