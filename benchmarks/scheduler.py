"""Gang scheduler decision latency at the size of Google's largest published v5e run.

200 v5litepod-256 slices (51,200 chips; Google Cloud, 2023: 50,944 v5e chips in one job) and
a queue kept near 10,000 requests of mixed sizes and priorities. A stream of events
(a gang finishes, a request arrives, a preempted gang checkpoints and releases) is each
followed by one `schedule()`: one decision, timed. The naive baseline
(benchmarks/naive_scheduler.py) makes the same decisions on a prefix of the same stream,
checked step by step, and its latency is printed next to ours with the ratio.

    .venv/bin/python -m benchmarks.scheduler [--quick] [--json PATH]
    slicewise bench scheduler        (writes results/scheduler.json and .png)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import machine, summarize
from benchmarks.naive_scheduler import NaiveScheduler
from controller.inventory import Host, Slice
from controller.scheduler import (
    Admission,
    Decision,
    ForceRelease,
    GangRequest,
    Preempt,
    Scheduler,
)
from slicewise.common.topology import SLICE_TYPES, slice_type

NUM_SLICES = 200
SLICE = SLICE_TYPES["v5litepod-256"]
QUEUE = 10_000
SIZES = {1: 35, 2: 25, 4: 20, 8: 12, 16: 6, 32: 1.5, 64: 0.5}  # slices per gang: weight
# The backlog is mostly best-effort work; arrivals are more urgent, so that they preempt.
BACKLOG_PRIORITIES = {0: 90, 1: 8, 2: 2}
PRIORITIES = {0: 60, 1: 25, 2: 10, 3: 5}
MAX_WAIT_SHARE = 0.1  # requests that give up after 5-60 min
FULL = {"decisions": 10_000, "naive_decisions": 300}
QUICK = {"decisions": 300, "naive_decisions": 5}


class Stream:
    """A stand-in controller driving one scheduler through a seeded stream of events."""

    def __init__(self, make: Callable[[Callable[[], float]], Any], seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 1_000.0
        self.scheduler = make(lambda: self.now)
        self.scheduler.set_inventory({s.name: s for s in cluster()})
        self.running: list[str] = []
        self.checkpointing: dict[str, float] = {}  # victim -> when it releases
        self.ids = 0
        for _ in range(QUEUE):
            self.submit(BACKLOG_PRIORITIES)

    def submit(self, priorities: dict[int, float] = PRIORITIES) -> None:
        rng = self.rng
        self.ids += 1
        # A fifth ask by topology: the controller resolves "16x16" to the same slice type.
        stype = slice_type("16x16") if rng.random() < 0.2 else SLICE
        wait = rng.uniform(300, 3600) if rng.random() < MAX_WAIT_SHARE else None
        self.scheduler.submit(
            GangRequest(
                f"r{self.ids}",
                rng.choices(list(SIZES), list(SIZES.values()))[0],
                stype,
                priority=rng.choices(list(priorities), list(priorities.values()))[0],
                max_wait_s=wait,
            )
        )

    def event(self, step: int) -> None:
        """One event: a victim releases if one is due, else a gang ends or a request arrives."""
        self.now += self.rng.expovariate(1.0)
        due = sorted(v for v, t in self.checkpointing.items() if t <= self.now)
        if due:
            self.release(due[0])
        elif step % 2 and self.running:
            self.release(self.running[self.rng.randrange(len(self.running))])
        else:
            self.submit()
        if len(self.scheduler.queued()) < QUEUE:  # expiries drain it; keep it full
            self.submit()

    def release(self, gang: str) -> None:
        self.scheduler.release(gang)
        self.running.remove(gang)
        self.checkpointing.pop(gang, None)

    def apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            if isinstance(d, Admission):
                self.running.append(d.request_id)
            elif isinstance(d, Preempt):
                # Most victims checkpoint within the 30 s grace period; some do not.
                self.checkpointing[d.victim_id] = self.now + self.rng.uniform(5, 40)
            elif isinstance(d, ForceRelease):
                self.running.remove(d.victim_id)
                self.checkpointing.pop(d.victim_id, None)

    def decide(self) -> tuple[list[Decision], float]:
        started = time.perf_counter_ns()
        decisions = self.scheduler.schedule()
        elapsed_ms = (time.perf_counter_ns() - started) / 1e6
        self.apply(decisions)
        return decisions, elapsed_ms


def cluster() -> list[Slice]:
    """200 intact v5litepod-256 slices of 64 hosts each."""
    return [
        Slice(
            f"slice-{i:03d}",
            SLICE,
            tuple(
                Host(
                    f"slice-{i:03d}-w{w}",
                    f"10.{i // 250}.{i % 250}.{w}",
                    w,
                    SLICE.chips_per_host,
                    True,
                )
                for w in range(SLICE.hosts)
            ),
            simulated=False,
        )
        for i in range(NUM_SLICES)
    ]


def percentiles(times: list[float]) -> dict[str, float]:
    """Latency at a few percentiles, for the plot."""
    ordered = sorted(times)
    return {
        str(q): ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
        for q in (1, 10, 25, 50, 75, 90, 95, 99, 99.9, 100)
    }


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """Runs the benchmark; returns the figures (latencies in ms per decision)."""
    sizes = QUICK if quick else FULL
    ours, naive = Stream(Scheduler, seed), Stream(NaiveScheduler, seed)
    first, _ = ours.decide()  # fills the empty cluster: not a steady-state decision
    assert first == naive.decide()[0]
    ours_times, naive_times, kinds = [], [], Counter()
    for step in range(sizes["decisions"]):
        ours.event(step)
        decisions, elapsed = ours.decide()
        ours_times.append(elapsed)
        kinds.update(type(d).__name__ for d in decisions)
        if step < sizes["naive_decisions"]:
            naive.event(step)
            same, naive_elapsed = naive.decide()
            assert same == decisions, f"decision {step}: naive {same} != ours {decisions}"
            naive_times.append(naive_elapsed)
    prefix = summarize(ours_times[: len(naive_times)])
    baseline = summarize(naive_times)
    return {
        "machine": machine(),
        "python": platform.python_version(),
        "config": {
            "slices": NUM_SLICES,
            "slice_type": SLICE.name,
            "chips": NUM_SLICES * SLICE.chips,
            "queued": QUEUE,
            "sizes": SIZES,
            "backlog_priorities": BACKLOG_PRIORITIES,
            "arrival_priorities": PRIORITIES,
            "seed": seed,
            "quick": quick,
            **sizes,
        },
        "unit": "ms per decision",
        "queue_at_end": len(ours.scheduler.queued()),
        "decisions_made": dict(kinds),
        "ours": summarize(ours_times),
        "ours_on_naive_prefix": prefix,
        "naive": baseline,
        "same_decisions_checked": len(naive_times),
        "ratio_median": baseline["median"] / prefix["median"],
        "ratio_p99": baseline["p99"] / prefix["p99"],
        "percentiles": {"ours": percentiles(ours_times), "naive": percentiles(naive_times)},
    }


def report(result: dict[str, Any]) -> str:
    """The figures as a small table."""
    c, m = result["config"], result["machine"]
    lines = [
        f"{c['slices']} x {c['slice_type']} ({c['chips']:,} chips), queue kept near "
        f"{c['queued']:,} (ends at {result['queue_at_end']:,}); python {result['python']}, "
        f"{m['cores']} cores ({m['cpu']})",
        f"decisions made: {result['decisions_made']}",
        f"{'ms per decision':<30}{'median':>10}{'p99':>10}{'min':>10}{'max':>10}{'n':>8}",
    ]
    for label, s in [
        ("ours, whole stream", result["ours"]),
        ("ours, first decisions", result["ours_on_naive_prefix"]),
        ("naive, same first decisions", result["naive"]),
    ]:
        lines.append(
            f"{label:<30}{s['median']:>10.3f}{s['p99']:>10.3f}{s['min']:>10.3f}"
            f"{s['max']:>10.3f}{s['n']:>8}"
        )
    lines.append(
        f"naive / ours: {result['ratio_median']:.0f}x at the median, "
        f"{result['ratio_p99']:.0f}x at p99 ({result['same_decisions_checked']} "
        "decisions checked identical)"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Latency percentiles of ours and the naive baseline, log scale."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, style in [("ours", "o-"), ("naive", "s--")]:
        points = result["percentiles"][name]
        ax.plot([float(q) for q in points], list(points.values()), style, label=name)
    ax.axhline(10, color="tab:red", linestyle=":", label="10 ms target (p99)")
    ax.set_yscale("log")
    ax.set_xlabel("percentile of decisions")
    ax.set_ylabel("ms per schedule() decision")
    ax.set_title(
        f"gang scheduler, {result['config']['slices']} x "
        f"{result['config']['slice_type']}, ~{result['config']['queued']:,} queued"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run, for a smoke test")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
