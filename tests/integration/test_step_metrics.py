"""Step times and tokens/s of a training job are what its workers measured, whatever the
timing of the (batched) completions that carry them to the controller."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections import defaultdict
from itertools import pairwise
from statistics import median

import pytest

from controller.jobview import TERMINAL, step_time
from programs.base import get_program
from protos import controller_pb2 as pb
from slicewise.testing import wait_until

pytestmark = pytest.mark.integration

# Steps of about 250 ms on a 2-core machine (mostly gloo collectives between the two
# hosts): long next to a worker's own work between programs, quick enough for 40.
CONFIG = {
    "d_model": "64",
    "n_layers": "2",
    "n_heads": "4",
    "d_ff": "256",
    "seq_len": "64",
    "batch_size": "16",
    "warmup_steps": "5",
    "total_steps": "40",
}
STEPS = 40
WARM = 3  # the first steps compile, and the pipeline fills


def step_seconds_sample(url: str) -> tuple[float, float]:
    """(count, sum) of the controller's slicewise_step_seconds histogram."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] not in "#")
    return (
        float(samples.get("slicewise_step_seconds_count", 0)),
        float(samples.get("slicewise_step_seconds_sum", 0)),
    )


def timelines(trace: dict) -> dict[str, dict[str, list[dict]]]:
    """process name ("controller", "host 0 of slice ...") -> thread name -> its spans,
    from a Chrome trace."""
    processes, threads = {}, {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e["ph"] == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    out: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out[processes[e["pid"]]][threads[(e["pid"], e["tid"])]].append(e)
    return out


def program_runs(spans: list[dict], name: str) -> list[tuple[int, int, int]]:
    """Each run of program `name` on one host, in order, as (seq, microseconds on the
    devices, end), worked out from the raw span times: from its launch, or from the end
    of the program before it if that was later, to its end."""
    runs, previous_end = [], 0
    for s in sorted(spans, key=lambda s: s["args"]["seq"]):
        end = s["ts"] + s["dur"]
        launched = s["args"].get("launched_us", s["ts"])
        if s["name"] == name:
            runs.append((s["args"]["seq"], end - max(launched, previous_end), end))
        previous_end = end
    return runs


def test_step_times_are_the_workers_own_measurements(controller, client):
    assert controller.metrics_url, "the shared controller was started without --metrics-port"
    histogram_before = step_seconds_sample(controller.metrics_url)
    job = client.submit_job("lm", slices=2, slice_type="v5litepod-4", steps=STEPS, overrides=CONFIG)
    done = wait_until(
        lambda: (j := client.job(job.job_id)).state in TERMINAL and j,
        timeout_s=600,
        interval_s=0.5,
        what=f"job {job.job_id} to end",
    )
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
    steps = list(client.job_metrics(job.job_id).steps)
    assert [s.step for s in steps] == list(range(STEPS))
    reported = [s.step_time_s for s in steps]

    # The workers' own timelines, taken apart from the job's records: every host's runs
    # of the step program, in order (the k-th is step k).
    processes = timelines(client.trace(done.job_id))  # a job's trace is its gang's
    hosts = {name: t for name, t in processes.items() if name.startswith("host ")}
    assert len(hosts) == 2, list(processes)
    runs = {h: program_runs(t["programs"], "execute lm.step") for h, t in hosts.items()}
    assert all(len(r) == STEPS for r in runs.values()), {h: len(r) for h, r in runs.items()}

    # Completions really travelled in batches: fewer frames than operations on every
    # host (and, when steps completed close together, several steps in one frame).
    for host, threads in hosts.items():
        frames = [s["args"]["seqs"] for s in threads["control"]]
        completed = sum(len(f) for f in frames)
        assert len(frames) < completed, (host, len(frames), completed)
        step_seqs = {seq for seq, _, _ in runs[host]}
        several = sum(1 for f in frames if len(step_seqs.intersection(f)) > 1)
        print(f"{host}: {completed} completions in {len(frames)} frames, {several} with >1 step")

    # Each step's reported time is the slowest host's time on the devices for it.
    spans_s = [max(r[k][1] for r in runs.values()) / 1e6 for k in range(STEPS)]
    ratios = [a / b for a, b in zip(reported[WARM:], spans_s[WARM:], strict=True)]
    print(
        f"median step {1e3 * median(reported[WARM:]):.1f} ms reported, "
        f"{1e3 * median(spans_s[WARM:]):.1f} ms in the workers' spans; reported/spans: "
        f"median {median(ratios):.4f}, range {min(ratios):.4f}..{max(ratios):.4f}; "
        f"step 0 (compiles) {reported[0]:.2f} s"
    )
    assert abs(median(ratios) - 1) <= 0.2, ratios
    assert all(abs(r - 1) <= 0.2 for r in ratios), ratios

    # No time counted twice: the steps' times add up to no more than the time they took
    # on a host (less where the devices waited for work).
    first_run = next(iter(runs.values()))
    elapsed_s = (first_run[-1][2] - first_run[WARM - 1][2]) / 1e6
    settled = sorted(
        e["ts"] + e["dur"]
        for spans in processes["controller"].values()
        for e in spans
        if e["name"] == "dispatch exec" and e["args"]["seq"] in {seq for seq, _, _ in first_run}
    )
    arrivals_ms = [(b - a) / 1e3 for a, b in pairwise(settled[WARM:])]
    print(
        f"steps {WARM}.. took {sum(reported[WARM:]):.2f} s of {elapsed_s:.2f} s on "
        f"{next(iter(runs))}; the controller settled them {min(arrivals_ms):.1f} ms to "
        f"{max(arrivals_ms):.1f} ms apart"
    )
    assert sum(reported[WARM:]) <= 1.2 * elapsed_s

    # Tokens/s is tokens per step over that time.
    program = get_program("lm")
    tokens = program.tokens_per_step(program.make_config(CONFIG))
    for s in steps:  # as a product, so a missing (zero) step time fails here too
        assert s.tokens_per_s * s.step_time_s == pytest.approx(tokens, rel=1e-9)

    # The Prometheus histogram got the same figures (no other job runs meanwhile).
    count, total = step_seconds_sample(controller.metrics_url)
    assert count - histogram_before[0] == STEPS
    assert total - histogram_before[1] == pytest.approx(sum(reported))

    # And `slicewise jobs` shows the last one.
    table = subprocess.run(
        [sys.executable, "-m", "controller.cli", "jobs", "--controller", controller.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert table.returncode == 0, table.stderr
    (row,) = [ln for ln in table.stdout.splitlines() if f" {job.job_id} " in ln]
    last = steps[-1]
    assert step_time(last.step_time_s) in row and f"{last.tokens_per_s:,.0f}" in row, row
