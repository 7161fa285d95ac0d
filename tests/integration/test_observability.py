"""What a user sees: Prometheus metrics that move, and a timeline with every host."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import jax
import numpy as np
import pytest

from programs.demo import slow_increment

pytestmark = pytest.mark.integration


def scrape(url: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value} (comments skipped)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        v
        for k, v in samples.items()
        if re.match(rf"{name}(\{{|$)", k) and all(w in k for w in want)
    )


def test_metrics_endpoint_moves_during_a_run(controller, client):
    assert controller.metrics_url, "the shared controller was started without --metrics-port"
    before = scrape(controller.metrics_url)
    with client.allocate(slices=2, slice_type="v5litepod-4", timeout=120) as gang:
        during_alloc = scrape(controller.metrics_url)
        assert total(during_alloc, "slicewise_gangs") >= 1
        assert total(during_alloc, "slicewise_slices", state="held") >= 2
        mesh = gang.mesh()
        x = gang.put(np.ones((64, 64), np.float32), mesh.sharding(("slice", "chip")))
        inc = gang.compile(jax.jit(lambda a: a + 1), x)
        y = x
        for _ in range(10):
            y = inc(y)
        y.fetch()
        after = scrape(controller.metrics_url)
    for name, labels in [
        ("slicewise_operations_total", {"kind": "exec"}),
        ("slicewise_dispatch_latency_seconds_count", {"kind": "exec"}),
        ("slicewise_bytes_total", {"direction": "put"}),
        ("slicewise_bytes_total", {"direction": "fetch"}),
        ("slicewise_rpc_seconds_count", {"method": "AllocateGang"}),
        ("slicewise_stream_calls_total", {}),
    ]:
        grew = total(after, name, **labels) - total(before, name, **labels)
        assert grew > 0, f"{name}{labels} did not move ({grew})"
    assert (
        total(after, "slicewise_operations_total", kind="exec")
        - total(before, "slicewise_operations_total", kind="exec")
        >= 10
    )
    assert (
        total(after, "slicewise_stream_calls_total") - total(before, "slicewise_stream_calls_total")
        >= 10
    )
    assert (
        total(after, "slicewise_bytes_total", direction="put")
        - total(before, "slicewise_bytes_total", direction="put")
        == 64 * 64 * 4
    )
    refused_before = total(before, "slicewise_failures_total")
    with pytest.raises(Exception, match="unknown slice type"):
        client.allocate(slices=1, slice_type="v5litepod-3")
    assert total(scrape(controller.metrics_url), "slicewise_failures_total") > refused_before


def test_trace_has_spans_from_every_host_of_the_gang(controller, client, tmp_path):
    with client.allocate(slices=1, slice_type="v5litepod-16", timeout=120) as gang:
        mesh = gang.mesh()
        x = gang.put(np.zeros(16, np.float32), mesh.sharding("chip"))
        step = gang.compile(slow_increment(mesh.abstract, iters=4, axis="chip"), x)
        y = x
        for _ in range(5):
            y = step(y)
        assert y.fetch().tolist() == [5.0] * 16
        gang_id = gang.id
    # After release, from the command line, as a user would.
    out = tmp_path / "trace.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "controller.cli",
            "trace",
            gang_id,
            "-o",
            str(out),
            "--controller",
            controller.address,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    trace = json.loads(out.read_text())
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    hosts = {p for p, n in names.items() if n.startswith("host ")}
    assert len(hosts) == 4, names  # v5litepod-16: 4 hosts
    for pid in hosts:
        executes = [
            s
            for s in spans
            if s["pid"] == pid and s["cat"] == "execute" and s["name"].startswith("execute ")
        ]
        assert len(executes) >= 5, (names[pid], len(executes))
        assert any(s["cat"] == "transfer" for s in spans if s["pid"] == pid), names[pid]
    controller_pid = next(p for p, n in names.items() if n == "controller")
    dispatch = [s for s in spans if s["pid"] == controller_pid and s["cat"] == "dispatch"]
    assert sum(1 for s in dispatch if s["name"] == "dispatch exec") >= 5
    assert all(s["dur"] >= 0 and s["ts"] > 0 for s in spans)
