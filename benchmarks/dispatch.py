"""Dispatch throughput: the Pathways paper's micro-benchmark (Barham et al., 2022, Fig. 5
and 6) on a simulated 2-slice gang.

A trivial gang-wide computation (a scalar all-reduce over every chip plus a scalar add)
is run three ways through slicewise, in computations per second:
  OpByOp  - one call per computation on the gang's call stream (asynchronous, each on
            the previous one's output; waited for at the end), and the same waited for
            one by one;
  Chained - `Program.chain(128, x)`: 128 computations as one call of 128 runs, which
            the workers launch back to back (the paper's "chained": one call from the
            user's code for a chain of dependent computations);
  Fused   - 128 computations compiled into one program;
against (a) multi-controller JAX running the same loop on the same worker processes with
no controller, and (b) a plain Ray driver calling ordinary actors once per computation,
both driven from a process of their own (baselines.BaselineDriver). Every rate is
measured once per round, the rounds alternating their order, and each ratio is the
median of the rounds' ratios: two rates of one round were measured moments apart (this
shared VM's speed drifts by tens of percent within a minute).
Then the paper's Figure 6 sweep: the computation made longer (SWEEP_MS: 1 to 100 ms of
a multi-controller call, the work for each placed by measuring two programs first, as
this VM's speed varies from day to day) to find the shortest computation for which
slicewise's OpByOp throughput reaches 95% of multi-controller JAX (the paper reports
2.3 ms at 16 hosts);
at each length the ratio is the median of such rounds, each measuring both (more of them
within a factor of 2 of 2.3 ms, where the break-even falls). The break-even is given as
the paper defines it, the shortest length reaching 95%, and as the shortest from which
every longer length measured reaches it too.

It also prints where each OpByOp call's CPU goes (client, controller, workers; the
workers' by thread, against their own cost when they run the loop themselves, flat out
and at OpByOp's pace), how busy the cores were and what ratio the CPU per call alone
allows, the same for both sides at each length of the sweep (and so how much CPU a call
may cost beyond the workers' own loop to break even at the paper's 2.3 ms), and the
controller's CPU per call on gangs of 1, 2, 4 and 8 hosts, extrapolated to a
12,800-host gang, and what one wake-up of a process costs here by how it waits (each
frame of completions wakes the controller: benchmarks/wakeups.py).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import wakeups
from benchmarks.common import (
    CpuMeter,
    ThreadCpuMeter,
    interleaved,
    round_ratios,
    sim_controller,
    write_result,
)

SIM = "2xv5litepod-4"
AXES = ("slice", "chip")
CHAIN = 128
WINDOW = 3
BUDGET_CALLS = 2000  # calls over which CPU per call is measured
BUDGET_ROUNDS = 4  # in turns of BUDGET_CALLS / BUDGET_ROUNDS
# OpByOp, the workers' own loop, and the same loop at OpByOp's pace: "slicewise" first.
BUDGET_RUNS = ("slicewise", "multi_controller", "multi_controller_paced")

# A worker's threads, by what they do (worker/actor.py names them); threads Python does
# not know are native: XLA's (the devices' and its dispatch) and gloo's.
THREAD_GROUPS = {
    "in-order-executor": "executor",
    "executor-watcher": "watcher",
    "control-receiver": "control receive",
    "control-sender": "control send",
    "bench-loop": "own loop",
}
NATIVE = "native (XLA, gloo)"


def thread_group(name: str | None) -> str:
    return NATIVE if name is None else THREAD_GROUPS.get(name, "other Python")


def _rate(n: int, fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return n / (time.perf_counter() - started)


def _opbyop_async(program: Any, x: Any, n: int) -> float:
    def run() -> None:
        y = x
        for _ in range(n):
            y = program(y)
        y.block_until_ready()

    return _rate(n, run)


def _opbyop_waited(program: Any, x: Any, n: int) -> float:
    def run() -> None:
        y = x
        for _ in range(n):
            y = program(y).block_until_ready()

    return _rate(n, run)


def _chained(program: Any, x: Any, batches: int) -> float:
    def run() -> None:
        y = x
        for _ in range(batches):
            y = program.chain(CHAIN, y)
        y.block_until_ready()

    return _rate(batches * CHAIN, run)


def _fused(program: Any, x: Any, calls: int) -> float:
    """Computations per second: each call of the fused program is CHAIN of them."""
    return CHAIN * _opbyop_async(program, x, calls)


def _metered(meter: CpuMeter, measure: Any, *args: Any) -> float:
    """`measure(*args)`, a rate, with `meter` counting the CPU it takes."""
    with meter:
        return float(measure(*args))


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": float(np.median(values)), "min": min(values), "max": max(values)}


# Each headline ratio: (ours, the baseline it is measured against), as rates' names.
RATIOS = {
    "opbyop_vs_multi_controller": ("opbyop", "multi_controller"),
    "chained_vs_multi_controller": ("chained", "multi_controller"),
    "fused_vs_multi_controller_fused": ("fused", "multi_controller_fused"),
    "opbyop_vs_plain_ray_pipelined": ("opbyop", "plain_ray_pipelined"),
    "opbyop_waited_vs_plain_ray_waited": ("opbyop_waited", "plain_ray_waited"),
}
SHAPES = ("opbyop", "opbyop_waited", "chained", "fused")


def run(quick: bool = False) -> dict[str, Any]:
    import slicewise
    from benchmarks.baselines import BaselineDriver
    from programs.microbench import allreduce_add, fused_allreduce_add
    from slicewise.common.mesh import GangShape

    n = 200 if quick else 1000
    reps = 2 if quick else 6
    targets_ms = QUICK_SWEEP_MS if quick else SWEEP_MS
    out: dict[str, Any] = {
        "config": {
            "sim": SIM,
            "chain": CHAIN,
            "calls": n,
            "rounds": reps,
            "window": WINDOW,
            "quick": quick,
        }
    }
    with (
        sim_controller(SIM) as controller,
        slicewise.connect(controller.address) as client,
        BaselineDriver(controller.address) as driver,
    ):
        gang = client.allocate(slices=2, slice_type="v5litepod-4", timeout=300)
        mesh = gang.mesh(dcn={"slice": 2}, ici={"chip": 4})
        x = gang.put(np.zeros(8, np.float32), mesh.sharding(AXES))
        step = gang.compile(allreduce_add(mesh.abstract, AXES), x, name="allreduce_add")
        fused = gang.compile(fused_allreduce_add(mesh.abstract, AXES, CHAIN), x, name="fused")
        check = step.chain(CHAIN, x)
        assert check.fetch().tolist() == [float(CHAIN)] * 8, "the benchmark computes wrongly"
        fused(x).block_until_ready()
        workers = gang.stats().workers
        actors = [w.actor_name for w in workers]

        def multi_controller(program: Any, calls: int, pace_s: float = 0.0) -> float:
            return driver.multi_controller_rate(
                actors, program.id, [x.handle], calls, WINDOW, pace_s
            )

        # The driver is a client too: its CPU counts as the client's (it idles while
        # slicewise is measured, as the client does while the baselines are).
        pids = {
            "client": [os.getpid(), driver.pid],
            "controller": [controller.pid],
            "workers": [w.pid for w in workers],
        }
        # CPU is read in clock ticks (10 ms): enough calls for a few hundred of them,
        # in rounds that take turns (see common.interleaved), each meter summing its rounds.
        budget = {run: CpuMeter(pids) for run in BUDGET_RUNS}
        threads = {run: ThreadCpuMeter(pids["workers"]) for run in BUDGET_RUNS}
        chunk = BUDGET_CALLS // BUDGET_ROUNDS
        done = dict.fromkeys(BUDGET_RUNS, 0)

        def budget_run(run: str) -> float:
            with budget[run], threads[run]:
                if run == "slicewise":
                    _opbyop_async(step, x, chunk)
                elif run == "multi_controller":
                    multi_controller(step, chunk)
                else:
                    # The same loop fed at OpByOp's pace: what XLA's threads spend going
                    # idle and being woken between calls, which the unpaced loop never pays.
                    multi_controller(step, chunk, budget["slicewise"].wall_s / done["slicewise"])
            done[run] += chunk
            return 0.0

        interleaved(BUDGET_ROUNDS, {run: functools.partial(budget_run, run) for run in BUDGET_RUNS})
        thread_names = driver.worker_thread_names(actors)

        nodes = [
            h.node_id
            for s in client.cluster_info().slices
            if s.name in gang.slices
            for h in s.hosts
        ]
        zeros = np.zeros(8, np.float32)
        driver.plain_ray(
            GangShape(2, 1, 4), nodes, step.exported.serialize(), mesh.spec, zeros, (AXES,)
        )
        batches = max(1, 2 * n // CHAIN)  # about as long as n OpByOp calls
        rates = interleaved(
            reps,
            {
                "opbyop": lambda: _opbyop_async(step, x, n),
                "multi_controller": lambda: multi_controller(step, n),
                "chained": lambda: _chained(step, x, batches),
                "fused": lambda: _fused(fused, x, batches),
                "multi_controller_fused": lambda: CHAIN * multi_controller(fused, batches),
                "opbyop_waited": lambda: _opbyop_waited(step, x, n // 4),
                "plain_ray_pipelined": lambda: driver.plain_pipelined(n // 2),
                "plain_ray_waited": lambda: driver.plain_waited(n // 4),
            },
        )

        programs: dict[int, Any] = {}

        def with_work(iters: int) -> Any:
            if iters not in programs:
                programs[iters] = gang.compile(
                    allreduce_add(mesh.abstract, AXES, work_iters=iters),
                    x,
                    name=f"allreduce_add_work{iters}",
                )
                programs[iters](x).block_until_ready()
            return programs[iters]

        # The work iterations that make each length of the sweep on this machine, from
        # the lengths of two programs (this VM's speed differs by half from day to day:
        # fixed iteration counts once put no length between 1.7 and 2.8 ms).
        base_ms, long_ms = (
            1e3 / float(np.median([multi_controller(with_work(i), 100) for _ in range(5)]))
            for i in (0, CALIBRATION_ITERS)
        )
        lengths = sweep_iters(base_ms, (long_ms - base_ms) / CALIBRATION_ITERS, targets_ms)
        out["config"]["sweep_targets_ms"] = list(targets_ms)
        sweep = []
        for iters in lengths:
            program = with_work(iters)
            mc_rate = multi_controller(program, 20)
            calls = int(min(n, max(20, 1.5 * mc_rate)))  # about 1.5 s per measurement
            rounds = _sweep_rounds(reps, 1e3 / mc_rate, quick)
            # Both sides' CPU, summed over their rounds: what each call costs at this length.
            meters = {side: CpuMeter(pids) for side in SWEEP_SIDES}
            paired = interleaved(
                rounds,
                {
                    "multi_controller": functools.partial(
                        _metered, meters["multi_controller"], multi_controller, program, calls
                    ),
                    "slicewise": functools.partial(
                        _metered, meters["slicewise"], _opbyop_async, program, x, calls
                    ),
                },
            )
            ratios = round_ratios(paired, "slicewise", "multi_controller")
            mc_rate = float(np.median(paired["multi_controller"]))
            sweep.append(
                {
                    "work_iters": iters,
                    "length_ms": 1e3 / mc_rate,
                    "calls": calls,
                    "rounds": rounds,
                    "slicewise": float(np.median(paired["slicewise"])),
                    "multi_controller": mc_rate,
                    "ratio": float(np.median(ratios)),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    **length_cpu(
                        {side: m.used for side, m in meters.items()},
                        {side: m.wall_s for side, m in meters.items()},
                        calls * rounds,
                    ),
                }
            )
        gang.release()

    # What a wake-up costs a process here, by how it waits: the floor under the
    # controller's CPU per frame of completions (benchmarks/wakeups.py).
    out["wakeup_cpu_us"] = wakeups.run(count=50 if quick else wakeups.MESSAGES)
    by_round = {name: round_ratios(rates, *pair) for name, pair in RATIOS.items()}
    out["shapes"] = {name: _summary(rates[name]) for name in SHAPES}
    out["baselines"] = {name: _summary(rates[name]) for name in rates if name not in SHAPES}
    # Each ratio is the median of the rounds' ratios, each round's two rates measured
    # moments apart (see common.interleaved); the rounds' own are in round_ratios.
    out["ratios"] = {name: float(np.median(values)) for name, values in by_round.items()}
    out["round_ratios"] = by_round
    out["sweep"] = sweep
    out["controller_scaling"] = controller_scaling(quick)
    # CPU per computation, in microseconds, by where it is spent: slicewise's OpByOp
    # against the same loop run by the workers themselves (whose CPU is the floor).
    out["cpu_per_call_us"] = {
        run: {group: 1e6 * used / done[run] for group, used in meter.used.items()}
        for run, meter in budget.items()
    }
    # The workers' CPU per call by thread (all hosts): where theirs goes beyond the loop's.
    out["worker_cpu_per_call_us_by_thread"] = {
        run: {
            group: 1e6 * used / done[run]
            for group, used in sorted(
                meter.grouped(thread_names, thread_group).items(), key=lambda kv: -kv[1]
            )
        }
        for run, meter in threads.items()
    }
    out["cpu_bound"] = cpu_bound(
        out["cpu_per_call_us"],
        {run: meter.wall_s for run, meter in budget.items()},
        BUDGET_CALLS,
        os.cpu_count() or 1,
        float(np.median(round_ratios(rates, "plain_ray_pipelined", "multi_controller"))),
    )
    out.update(break_even(sweep))
    out["break_even_from_cpu"] = break_even_from_cpu(sweep, PAPER_BREAK_EVEN_MS)
    return out


def cpu_bound(
    cpu_us: dict[str, dict[str, float]],
    wall_s: dict[str, float],
    calls: int,
    cores: int,
    plain_vs_multi_controller: float,
) -> dict[str, Any]:
    """What the CPU per call allows when client, controller and workers share the
    machine's cores and keep them busy (`cores_busy` near `cores` says they do): then
    calls per second are at most cores / CPU per call, and OpByOp's ratio to
    multi-controller is at most the ratio of their CPU per call.

    Args:
        cpu_us: CPU per call by process group ("client", "controller", "workers"), for
            the runs "slicewise" (OpByOp) and "multi_controller" (the workers' own loop).
        wall_s: how long each run's `calls` calls took.
        plain_vs_multi_controller: plain Ray pipelined's rate over multi-controller's.
    """
    ours, mc = cpu_us["slicewise"], cpu_us["multi_controller"]
    mc_total = sum(mc.values())
    runs = ("slicewise", "multi_controller")
    # The least OpByOp could spend: the workers at their own loop's figure, plus what
    # the client and controller spend to send the call.
    least = mc["workers"] + ours["client"] + ours["controller"]
    return {
        "cores": cores,
        "cores_busy": {run: sum(cpu_us[run].values()) * calls / 1e6 / wall_s[run] for run in runs},
        "opbyop_vs_multi_controller_from_cpu": mc_total / sum(ours.values()),
        "opbyop_ceiling_with_workers_at_their_loop": mc_total / least,
        "opbyop_needed_for_2x_plain_ray": 2 * plain_vs_multi_controller,
    }


# The sweep's lengths, in milliseconds of a multi-controller call: denser around the
# paper's 2.3 ms, where the break-even falls.
SWEEP_MS = (1.0, 1.5, 1.8, 2.0, 2.15, 2.3, 2.5, 2.8, 3.5, 5.0, 10.0, 30.0, 100.0)
QUICK_SWEEP_MS = (1.0, 3.0, 20.0)
CALIBRATION_ITERS = 100  # the second program measured to place the sweep's lengths


def sweep_iters(base_ms: float, per_iter_ms: float, targets_ms: Sequence[float]) -> list[int]:
    """The work iterations for each target length, on the line through the lengths of
    two programs (a call's work grows linearly with its iterations): `base_ms` with none,
    `per_iter_ms` more per iteration. Targets at or below `base_ms` take 0; each count
    once, in the targets' order.

    Raises:
        ValueError: the lengths do not grow with the iterations (a calibration that
            measured noise).
    """
    if per_iter_ms <= 0:
        raise ValueError(
            f"calibration failed: {CALIBRATION_ITERS} work iterations made a call no longer "
            f"({base_ms:.3f} ms with none, {per_iter_ms:+.5f} ms per iteration)"
        )
    iters: list[int] = []
    for target in targets_ms:
        n = max(0, round((target - base_ms) / per_iter_ms))
        if n not in iters:
            iters.append(n)
    return iters


SWEEP_SIDES = ("multi_controller", "slicewise")
BREAK_EVEN = 0.95  # the share of multi-controller's throughput that counts as reaching it
PAPER_BREAK_EVEN_MS = 2.3  # Barham et al., 2022, Fig. 6: 16 hosts
# Rounds at the lengths within a factor of NEAR of the paper's break-even: one round's
# ratio there ranges over 0.8-1.1 on the 2-core VM (paired runs of 2.3-ms calls,
# 2026-12-05), so the median of 6 moves by a few hundredths from run to run, as much
# as the margin being told.
NEAR = 2.0
NEAR_ROUNDS = 10


def _sweep_rounds(reps: int, length_ms: float, quick: bool) -> int:
    """Rounds for one length of the sweep: more near the paper's break-even."""
    near = 1 / NEAR <= length_ms / PAPER_BREAK_EVEN_MS <= NEAR
    return max(reps, NEAR_ROUNDS) if near and not quick else reps


def break_even(sweep: list[dict[str, Any]]) -> dict[str, float | None]:
    """The break-even of the sweep two ways: `break_even_ms`, the shortest length whose
    ratio reaches BREAK_EVEN (the paper's definition), and `break_even_sustained_ms`,
    the shortest from which every longer length measured reaches it too (one round's
    luck at a single length does not make it)."""
    points = sorted(sweep, key=lambda p: p["length_ms"])
    reached = [p["length_ms"] for p in points if p["ratio"] >= BREAK_EVEN]
    sustained = None
    for p in reversed(points):
        if p["ratio"] < BREAK_EVEN:
            break
        sustained = p["length_ms"]
    return {
        "break_even_ms": min(reached) if reached else None,
        "break_even_sustained_ms": sustained,
    }


def length_cpu(
    used_s: dict[str, dict[str, float]], wall_s: dict[str, float], calls: int
) -> dict[str, Any]:
    """One length of the sweep, by CPU: each side's CPU per call by process group, how
    many cores each kept busy, and the ratio the CPU alone allows.

    On the simulation the devices are the machine's own cores: a computation's work is
    CPU time, on the cores the client and controller use too. Where both sides keep the
    cores equally busy, each microsecond slicewise spends beyond the workers' own loop
    is taken from the computations, and its ratio to multi-controller is the ratio of
    their CPU per call (on the 2-core VM they matched within 0.04 at every length, with
    1.4-1.9 cores busy). `extra_us` is that surplus per call; `extra_allowed_us` the
    most that still reaches BREAK_EVEN.

    Args:
        used_s: CPU seconds by group ("client", "controller", "workers") for each side
            ("multi_controller", "slicewise") over all its rounds.
        wall_s: how long each side's rounds took in all.
        calls: computations each side ran over its rounds.
    """
    per_call = {
        side: {group: 1e6 * s / calls for group, s in used.items()} for side, used in used_s.items()
    }
    total = {side: sum(groups.values()) for side, groups in per_call.items()}
    mc, ours = total["multi_controller"], total["slicewise"]
    return {
        "cpu_per_call_us": per_call,
        "cores_busy": {side: sum(used_s[side].values()) / wall_s[side] for side in used_s},
        "ratio_from_cpu": mc / ours,
        "extra_us": ours - mc,
        "extra_allowed_us": mc * (1 / BREAK_EVEN - 1),
    }


def break_even_from_cpu(sweep: list[dict[str, Any]], target_ms: float) -> dict[str, Any] | None:
    """Where the sweep's CPU puts the break-even: the shortest length whose CPU-allowed
    ratio reaches BREAK_EVEN, and at `target_ms` (interpolated on a log scale between the
    lengths around it) the most a call may cost beyond the workers' own loop to reach it
    there, against what it cost at the nearest length measured. None without CPU figures."""
    points = sorted((p for p in sweep if "extra_us" in p), key=lambda p: p["length_ms"])
    if not points:
        return None
    lengths = np.log([p["length_ms"] for p in points])
    allowed = float(np.interp(np.log(target_ms), lengths, [p["extra_allowed_us"] for p in points]))
    nearest = min(points, key=lambda p: abs(np.log(p["length_ms"] / target_ms)))
    reached = [p["length_ms"] for p in points if p["ratio_from_cpu"] >= BREAK_EVEN]
    return {
        "break_even_ms": min(reached) if reached else None,
        "target_ms": target_ms,
        "extra_allowed_us_at_target": allowed,
        "nearest_ms": nearest["length_ms"],
        "extra_us_at_nearest": nearest["extra_us"],
        "extra_by_group_us_at_nearest": {
            group: nearest["cpu_per_call_us"]["slicewise"][group]
            - nearest["cpu_per_call_us"]["multi_controller"].get(group, 0.0)
            for group in nearest["cpu_per_call_us"]["slicewise"]
        },
    }


# Controller CPU per call by gang size: (hosts, slice type, slices), all on one simulation.
SCALING = [
    (1, "v5litepod-4", 1),
    (2, "v5litepod-4", 2),
    (4, "v5litepod-16", 1),
    (8, "v5litepod-32", 1),
]
SCALING_SIM = "2xv5litepod-4,v5litepod-16,v5litepod-32"
# A 51,200-chip v5e job: 200 slices of v5litepod-256, 64 hosts of 4 chips each.
TARGET_HOSTS = 12_800


def controller_scaling(quick: bool = False) -> dict[str, Any]:
    """The controller's CPU per call on gangs of 1, 2, 4 and 8 simulated hosts (an
    elementwise program over every chip, calls back to back on the call stream), fitted
    as a + b * hosts and extrapolated to TARGET_HOSTS."""
    import jax

    import slicewise

    calls = 500 if quick else BUDGET_CALLS
    points = []
    with (
        sim_controller(SCALING_SIM) as controller,
        slicewise.connect(controller.address) as client,
    ):
        for hosts, slice_type, slices in SCALING:
            with client.allocate(slices=slices, slice_type=slice_type, timeout=300) as gang:
                assert gang.num_slices * gang.hosts_per_slice == hosts
                mesh = gang.mesh()
                axes = tuple(mesh.shape)
                x = gang.put(np.zeros(gang.num_devices, np.float32), mesh.sharding(axes))
                inc = gang.compile(jax.jit(lambda a: a + 1), x, name="increment")
                inc(x).block_until_ready()
                meter = CpuMeter({"controller": [controller.pid]})
                started = time.perf_counter()
                with meter:
                    y = x
                    for _ in range(calls):
                        y = inc(y)
                    y.block_until_ready()
                seconds = time.perf_counter() - started
                assert float(y.fetch()[0]) == calls, "the scaling benchmark computes wrongly"
                points.append(
                    {
                        "hosts": hosts,
                        "gang": f"{slices} x {slice_type}",
                        "calls": calls,
                        "controller_cpu_us_per_call": 1e6 * meter.used["controller"] / calls,
                        "calls_per_s": calls / seconds,
                    }
                )
    hosts = np.array([p["hosts"] for p in points], float)
    cpu = np.array([p["controller_cpu_us_per_call"] for p in points])
    per_host, fixed = np.polyfit(hosts, cpu, 1)
    predicted = fixed + per_host * hosts
    r2 = 1 - float(np.sum((cpu - predicted) ** 2) / max(np.sum((cpu - cpu.mean()) ** 2), 1e-12))
    at_target = fixed + per_host * TARGET_HOSTS
    return {
        "points": points,
        "fit": {"fixed_us": float(fixed), "per_host_us": float(per_host), "r2": r2},
        "extrapolated": {
            "hosts": TARGET_HOSTS,
            "chips": TARGET_HOSTS * 4,
            "controller_cpu_ms_per_call": at_target / 1e3,
            "calls_per_s": 1e6 / at_target if at_target > 0 else None,
        },
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [
        "OpByOp",
        "OpByOp\n(waited)",
        "Chained",
        "Fused",
        "multi-ctrl\nJAX",
        "multi-ctrl\nJAX fused",
        "plain Ray\n(waited)",
        "plain Ray\n(pipelined)",
    ]
    s, b = result["shapes"], result["baselines"]
    values = [
        s["opbyop"]["median"],
        s["opbyop_waited"]["median"],
        s["chained"]["median"],
        s["fused"]["median"],
        b["multi_controller"]["median"],
        b["multi_controller_fused"]["median"],
        b["plain_ray_waited"]["median"],
        b["plain_ray_pipelined"]["median"],
    ]
    colors = ["tab:blue"] * 4 + ["tab:gray"] * 4
    left.bar(labels, values, color=colors)
    left.set_yscale("log")
    left.set_ylabel("computations / s")
    left.set_title("all-reduce + add over 8 chips of 2 simulated slices")
    left.tick_params(axis="x", labelsize=8)
    sweep = result["sweep"]
    lengths = [p["length_ms"] for p in sweep]
    right.plot(lengths, [p["slicewise"] for p in sweep], "o-", label="slicewise OpByOp")
    right.plot(lengths, [p["multi_controller"] for p in sweep], "s--", label="multi-controller JAX")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("computation length (ms, multi-controller step time)")
    right.set_ylabel("computations / s")
    if result.get("break_even_ms"):
        right.axvline(
            result["break_even_ms"],
            color="tab:green",
            linestyle=":",
            label=f"95% reached at {result['break_even_ms']:.1f} ms",
        )
    right.legend()
    right.set_title("throughput vs. computation length (paper Fig. 6)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _length(ms: float | None) -> str:
    return "not reached" if ms is None else f"{ms:.1f} ms"


def report(result: dict[str, Any]) -> str:
    s, b, r = result["shapes"], result["baselines"], result["ratios"]
    rounds = result["round_ratios"]
    lines = [
        f"OpByOp {s['opbyop']['median']:.0f}/s (waited {s['opbyop_waited']['median']:.0f}/s), "
        f"Chained {s['chained']['median']:.0f}/s, Fused {s['fused']['median']:.0f}/s",
        f"multi-controller JAX {b['multi_controller']['median']:.0f}/s "
        f"(fused {b['multi_controller_fused']['median']:.0f}/s); plain Ray "
        f"{b['plain_ray_waited']['median']:.0f}/s waited, "
        f"{b['plain_ray_pipelined']['median']:.0f}/s pipelined",
        "ratios (median of the rounds', min-max): "
        + ", ".join(
            f"{k} {v:.2f} ({min(rounds[k]):.2f}-{max(rounds[k]):.2f})" for k, v in r.items()
        ),
        "sweep (median of paired rounds, min-max): "
        + ", ".join(
            f"{p['length_ms']:.2f} ms -> {p['ratio']:.2f}"
            + (f" ({p['ratio_min']:.2f}-{p['ratio_max']:.2f})" if "ratio_min" in p else "")
            for p in result["sweep"]
        ),
        f"break-even (>= 95% of multi-controller): {_length(result['break_even_ms'])}; "
        "from there on at every longer length: "
        f"{_length(result.get('break_even_sustained_ms'))}",
    ]
    by_cpu = [p for p in result["sweep"] if "ratio_from_cpu" in p]
    if by_cpu:
        lines.append(
            "sweep by CPU (cores busy multi-controller/OpByOp; ratio the CPU per call allows; "
            "OpByOp's CPU per call beyond multi-controller's, and the most that reaches 95%): "
            + ", ".join(
                f"{p['length_ms']:.2f} ms: {p['cores_busy']['multi_controller']:.1f}/"
                f"{p['cores_busy']['slicewise']:.1f}, {p['ratio_from_cpu']:.2f}, "
                f"{p['extra_us']:.0f} of {p['extra_allowed_us']:.0f} us"
                for p in by_cpu
            )
        )
    cpu_even = result.get("break_even_from_cpu")
    if cpu_even:
        extra = cpu_even["extra_by_group_us_at_nearest"]
        lines.append(
            f"break-even by CPU: {_length(cpu_even['break_even_ms'])}; at "
            f"{cpu_even['target_ms']} ms a call may cost "
            f"{cpu_even['extra_allowed_us_at_target']:.0f} us of CPU beyond the workers' "
            f"own loop, and cost {cpu_even['extra_us_at_nearest']:.0f} us at "
            f"{cpu_even['nearest_ms']:.2f} ms ("
            + ", ".join(f"{g} {us:.0f}" for g, us in extra.items())
            + " us)"
        )
    scaling = result.get("controller_scaling")
    if scaling:
        fit, at = scaling["fit"], scaling["extrapolated"]
        lines.append(
            "controller CPU per call by hosts per gang: "
            + ", ".join(
                f"{p['hosts']}: {p['controller_cpu_us_per_call']:.0f} us" for p in scaling["points"]
            )
            + f"; fit {fit['fixed_us']:.0f} + {fit['per_host_us']:.1f} us x hosts "
            f"(R^2 {fit['r2']:.2f}); at {at['hosts']:,} hosts "
            f"{at['controller_cpu_ms_per_call']:.1f} ms per call, "
            f"{at['calls_per_s'] or 0:.1f} calls/s from one controller core"
        )
    cpu = result.get("cpu_per_call_us")
    if cpu:
        ours, floor = cpu["slicewise"], cpu["multi_controller"]
        paced = cpu.get("multi_controller_paced")
        at_pace = f", {paced['workers']:.0f} us at OpByOp's pace" if paced else ""
        lines.append(
            f"CPU per OpByOp call: client {ours['client']:.0f} us, controller "
            f"{ours['controller']:.0f} us, workers {ours['workers']:.0f} us (all hosts; "
            f"{floor['workers']:.0f} us when they run the loop themselves{at_pace})"
        )
    bound = result.get("cpu_bound")
    if bound:
        busy = bound["cores_busy"]
        lines.append(
            f"CPU-bound: {busy['slicewise']:.1f} (OpByOp) and {busy['multi_controller']:.1f} "
            f"(own loop) of {bound['cores']} cores busy; by CPU per call OpByOp reaches "
            f"{bound['opbyop_vs_multi_controller_from_cpu']:.2f} of multi-controller, and "
            f"at most {bound['opbyop_ceiling_with_workers_at_their_loop']:.2f} with the "
            "workers at their own loop's CPU (client and controller as measured); 2x plain "
            f"Ray needs {bound['opbyop_needed_for_2x_plain_ray']:.2f}"
        )
    wakeup = result.get("wakeup_cpu_us")
    if wakeup:
        lines.append(wakeups.report(wakeup))
    by_thread = result.get("worker_cpu_per_call_us_by_thread")
    if by_thread:
        for run, label in (
            ("slicewise", "OpByOp"),
            ("multi_controller", "their own loop"),
            ("multi_controller_paced", "their own loop at OpByOp's pace"),
        ):
            if run not in by_thread:
                continue
            lines.append(
                f"  workers' CPU per call by thread, {label}: "
                + ", ".join(f"{g} {us:.0f} us" for g, us in by_thread[run].items() if us >= 1)
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    result = run(args.quick)
    print(report(result))
    print(write_result("dispatch", result, plot))


if __name__ == "__main__":
    main()
