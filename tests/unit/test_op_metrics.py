"""The per-operation metrics, counted in plain Python and turned into Prometheus metric
families when scraped (controller/metrics.py): what a scrape shows is what
prometheus_client's own Counter and Histogram would have shown for the same values."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from controller.metrics import _LATENCY_BUCKETS, OperationMetrics

SECONDS = {"exec": [0.0002, 0.0005, 0.0031, 0.0031, 0.9, 75.0], "delete": [0.001], "load": []}


def exposition(registry: CollectorRegistry) -> list[str]:
    """The scrape's sample lines (no comments, no `_created` samples: prometheus_client's
    own counters and histograms add those, with the time they were made)."""
    text = generate_latest(registry).decode()
    return sorted(
        line for line in text.splitlines() if not line.startswith("#") and "_created" not in line
    )


def test_a_scrape_reads_as_prometheus_clients_own_counter_and_histogram():
    ours = CollectorRegistry()
    operations = OperationMetrics()
    ours.register(operations)
    theirs = CollectorRegistry()
    count = Counter("slicewise_operations_total", "n", ["kind"], registry=theirs)
    latency = Histogram(
        "slicewise_dispatch_latency_seconds",
        "s",
        ["kind"],
        buckets=_LATENCY_BUCKETS,
        registry=theirs,
    )
    for kind, values in SECONDS.items():
        if not values:
            continue
        for v in values:
            operations.tally(kind).observe(v)
            count.labels(kind).inc()
            latency.labels(kind).observe(v)
    assert exposition(ours) == exposition(theirs)
    assert 'slicewise_operations_total{kind="exec"} 6.0' in exposition(ours)


@pytest.mark.parametrize(
    ("seconds", "bucket"),
    [(0.0005, "0.0005"), (0.00051, "0.001"), (60.0, "60.0"), (60.5, "+Inf")],
)
def test_a_value_on_a_bound_counts_in_that_bucket_and_above_the_last_in_inf(seconds, bucket):
    registry = CollectorRegistry()
    operations = OperationMetrics()
    registry.register(operations)
    operations.tally("exec").observe(seconds)
    counts = {
        line.split('le="')[1].split('"')[0]: float(line.rpartition(" ")[2])
        for line in exposition(registry)
        if "_bucket" in line
    }
    bounds = [*(repr(float(b)) for b in _LATENCY_BUCKETS), "+Inf"]
    assert set(counts) == set(bounds)  # every bucket
    first = bounds.index(bucket)
    assert [counts[b] for b in bounds] == [0.0] * first + [1.0] * (len(bounds) - first)
