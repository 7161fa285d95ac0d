"""Asynchronous checkpoints: what saving every N steps costs a training job. Four
comparisons, each against a baseline measured in the same run:

(a) Step time of an LM job on one gang that saves every N steps (orbax, asynchronous:
    each worker's save thread copies the state out and commits it in the background
    while training goes on) vs. the same job saving nothing, for N = 10 and N = 50 (the
    controller's default). Target: at most 1.05x.
(b) The time training is blocked per save vs. a synchronous save of the same state.
(c) Save and restore throughput vs. raw writes (with fsync) and reads of the same bytes
    on the same filesystem.
(d) The CPU a save costs vs. the CPU a step costs: on this 2-core machine the
    simulated devices, the workers and the controller share the cores, so CPU spent
    saving is taken from the steps however asynchronous the save is. Where the cores
    are saturated, that puts a floor under (a).

How each figure is obtained:

- (a) Both jobs run on the same gang (2 simulated hosts, data parallel over the DCN),
  in alternating rounds (the order flips every round): on this shared 2-core machine
  step times move by tens of percent from one job to the next, far more than what is
  measured. Step time = the interval over the measured steps between when steps
  finished, by the workers' clocks (`StepMetrics.wall_time`), divided by their number:
  time the devices sat idle because of a save counts, while a step's own
  `step_time_s` would not count it (a step starts when it is launched). The first save
  of a job opens orbax's CheckpointManager and falls in the warm-up (its cost is
  reported on its own); the window then holds exactly one save per N steps. Ratio = the
  median round's.
  Saving jobs keep every step (`keep_checkpoints=0`), so that (b) can read each
  step's commit marker.
- (b) Blocked, asynchronous, in the job, from the workers' own spans (`client.trace`):
  how long the devices sat idle between the step that produced the saved state and
  the next one (the executor thread in the SaveOp, which only queues the save to the
  worker's save thread), and how much longer that next step ran (the save thread's
  copy and commit sharing the cores: on CPU "devices" it competes with the step
  itself, on a TPU host it would not); both beyond the steps before the save.
  Synchronous: in this process, with the job's state shapes (random values, as
  incompressible as trained weights), the time until a save is committed; the same
  save's `HostCheckpointer.save` returned after its copy to host memory (what the
  save thread spends before the commit). In the job, save to commit: the mtime of the
  step's commit marker minus when the step that produced the state finished (while
  the job trained on).
- (c) In this process, a state of many MiB: orbax save until committed vs. writing the
  same bytes to one file per array, fsync'd (tensorstore fsyncs what it writes); restore
  vs. reading those files back. Before each read, the files' pages are dropped from the
  page cache (posix_fadvise DONTNEED), so both read from the disk.
- (d) The machine's busy CPU time (all cores, /proc/stat, sampled every 20 ms) over
  each job's measured window: per step in the job saving nothing, and the share of
  the cores that keeps busy. Per save: the CPU time (all threads) of one host's save
  until committed, in this process with the job's state shapes, times the gang's
  hosts; and, as a cross-check, what the saving job used beyond the plain job's CPU
  per step (a small difference of large totals: noisy, most of all at N = 50). On
  saturated cores a save of W CPU seconds every N steps of c each costs at least
  W / (N c) of the step time: the bound printed; where the cores have idle time left,
  part of W can hide in it.
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import run_job, sim_controller, size_label, write_result
from benchmarks.train_overhead import CONFIGS as TRAIN_CONFIGS
from benchmarks.train_overhead import SLICE_TYPE

SIM = "2xv5litepod-1"
SLICES = 2
HOSTS = SLICES  # a v5litepod-1 slice is one host
SETTLE_S = 30.0
# label -> (LM config, {save every N steps: (measured steps per round, rounds)}). The
# ~50 ms step is train_overhead's; the ~400 ms one holds a state of tens of MiB. N = 50
# is the controller's default interval.
CONFIGS: dict[str, tuple[dict[str, str], dict[int, tuple[int, int]]]] = {
    "~50 ms": (TRAIN_CONFIGS["~50 ms"][1], {10: (60, 6), 50: (100, 6)}),
    "~400 ms": (
        {
            "d_model": "256",
            "n_layers": "4",
            "n_heads": "4",
            "d_ff": "1024",
            "seq_len": "64",
            "batch_size": "16",
        },
        {10: (30, 4), 50: (50, 4)},
    ),
}
HOST_SAVES = 6  # per config, after one that opens the checkpoint manager
IO_BYTES = 256 * 2**20
IO_ROUNDS = 5


# -- (a) and (b) in the job: pure arithmetic on what the workers measured --------------


def seconds_per_step(walls: Sequence[float], warm: int, n: int) -> float:
    """Seconds per step over steps warm..warm+n-1, from when each finished."""
    return (walls[warm + n - 1] - walls[warm - 1]) / n


def save_excess(walls: Sequence[float], every: int, first: int, n: int) -> dict[int, float]:
    """For each save in steps first..first+n-1 (the state after step index s-1, saved
    before step s runs, for s a multiple of `every`): how much longer step s took to
    finish after the step before it than the median of those steps' intervals that
    follow no save."""
    intervals = {s: walls[s] - walls[s - 1] for s in range(first, first + n)}
    usual = statistics.median(v for s, v in intervals.items() if s % every)
    return {s: v - usual for s, v in intervals.items() if s % every == 0}


def commit_latency(walls: Sequence[float], directory: Path, saves: Sequence[int]) -> list[float]:
    """Seconds from when the step that produced each saved state finished to when that
    save's commit marker was written (both by this machine's clock)."""
    from slicewise.common.checkpoints import COMMIT_FILE

    return [(directory / str(s) / COMMIT_FILE).stat().st_mtime - walls[s - 1] for s in saves]


def cpu_between(samples: Sequence[tuple[float, float]], t0: float, t1: float) -> float:
    """Busy CPU seconds between wall times t0 and t1, from (wall time, busy CPU seconds
    so far) samples in time order, interpolated linearly between samples."""
    times = [t for t, _ in samples]

    def at(t: float) -> float:
        i = min(max(bisect.bisect(times, t), 1), len(samples) - 1)
        (ta, ca), (tb, cb) = samples[i - 1], samples[i]
        return ca + (cb - ca) * (t - ta) / (tb - ta)

    return at(t1) - at(t0)


def cpu_bound(cpu_per_save_s: float, cpu_per_step_s: float, every: int) -> float:
    """The least step-time ratio saving every `every` steps can have on saturated
    cores: a save's CPU seconds added to `every` steps' CPU seconds."""
    return 1 + cpu_per_save_s / (every * cpu_per_step_s)


def save_breakdown(trace: dict[str, Any], saves: set[tuple[str, int]]) -> dict[str, list[float]]:
    """What each of `saves` (directory, step) did to the steps around it, from the workers'
    own spans in a gang's trace (the slowest host's figure per save, in seconds):

    - `op`: how long the save operation held the executor thread; it includes waiting
      for the steps still in flight to produce the state, time the devices were busy.
    - `idle`: how long the devices sat idle between the step that produced the state
      and the next one (the executor was still in the save, then built the next batch),
      beyond the usual gap between steps: the time training was blocked.
    - `slower`: how much longer the next step ran than the steps before the save (the
      background commit competing for the cores, and waits for a slower host).

    The usual gap and step are the medians of the 4 steps before the save."""
    hosts: dict[int, list[dict[str, Any]]] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") == "X" and "seq" in event.get("args", {}):
            hosts.setdefault(event["pid"], []).append(event)
    per_save: dict[tuple[str, int], list[float]] = {}
    for events in hosts.values():
        events.sort(key=lambda e: e["args"]["seq"])
        steps = [e for e in events if e["name"] == "execute lm.step"]
        seqs = [e["args"]["seq"] for e in steps]
        for e in events:
            args = e["args"]
            key = (args.get("directory"), args.get("step"))
            if not e["name"].startswith("save step") or key not in saves:
                continue
            i = bisect.bisect(seqs, args["seq"])  # steps[i]: the first step after the save
            before, after = steps[i - 5 : i], steps[i]
            ends = [b["ts"] + b["dur"] for b in before]
            usual_gap = statistics.median(
                b["ts"] - end for b, end in zip(before[1:], ends[:-1], strict=True)
            )
            usual_step = statistics.median(b["dur"] for b in before[1:])
            figures = [
                e["dur"],
                after["ts"] - ends[-1] - usual_gap,
                after["dur"] - usual_step,
            ]
            worst = per_save.setdefault(key, [-math.inf] * 3)
            per_save[key] = [max(w, f / 1e6) for w, f in zip(worst, figures, strict=True)]
    return {
        name: [figures[k] for figures in per_save.values()]
        for k, name in enumerate(("op", "idle", "slower"))
    }


def _measure_jobs(
    client: Any,
    gang: Any,
    root: Path,
    cpu: _CpuRecorder,
    label: str,
    overrides: dict[str, str],
    every: int,
    n: int,
    rounds: int,
) -> dict[str, Any]:
    """(a), (d), and (b) as the job sees it, for one LM config on `gang`: `rounds` pairs
    of jobs, one saving every `every` steps and one saving none, in alternating order."""
    warm = every + 5  # the first save, which opens the checkpoint manager, falls in it
    steps = warm + n
    plain_s, saving_s, ratios, excess, first, latency = [], [], [], [], [], []
    plain_cpu, saving_cpu = [], []  # busy CPU seconds over each job's measured window
    directories, saves = [], set()
    for r in range(rounds):
        for saving in (False, True) if r % 2 == 0 else (True, False):
            if not saving:
                records = run_job(client, steps, overrides=overrides, gang=gang, checkpoint_every=0)
                walls = [x.wall_time for x in records]
                plain_s.append(seconds_per_step(walls, warm, n))
                plain_cpu.append(cpu.between(walls[warm - 1], walls[warm + n - 1]))
                continue
            directory = root / f"{label.strip('~ ').replace(' ', '')}-{every}-{r}"
            directories.append(directory)
            records = run_job(
                client,
                steps,
                overrides=overrides,
                gang=gang,
                checkpoint_every=every,
                checkpoint_dir=str(directory),
                keep_checkpoints=0,
            )
            walls = [x.wall_time for x in records]
            saving_s.append(seconds_per_step(walls, warm, n))
            saving_cpu.append(cpu.between(walls[warm - 1], walls[warm + n - 1]))
            gaps = save_excess(walls, every, warm, n)
            excess.extend(gaps.values())
            saves.update((str(directory), s) for s in gaps)
            first.append(save_excess(walls, every, 1, warm - 1)[every])
            latency.extend(commit_latency(walls, directory, list(gaps)))
        ratios.append(saving_s[-1] / plain_s[-1])
    cost = every * statistics.median(s - p for s, p in zip(saving_s, plain_s, strict=True))
    spans = save_breakdown(client.trace(gang.id), saves)
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
    # (d): per round, the plain job's CPU per step, and what the saving job used beyond
    # that many steps' worth, per save.
    cpu_step = [c / n for c in plain_cpu]
    cpu_save = [(c - n * p) / (n // every) for c, p in zip(saving_cpu, cpu_step, strict=True)]
    busy = [c / ((os.cpu_count() or 1) * s) for c, s in zip(cpu_step, plain_s, strict=True)]
    return {
        "step": label,
        "overrides": overrides,
        "checkpoint_every": every,
        "warmup_steps": warm,
        "steps_per_round": n,
        "rounds": rounds,
        "saves_measured": len(excess),
        "plain_step_ms": 1e3 * statistics.median(plain_s),
        "async_step_ms": 1e3 * statistics.median(saving_s),
        "round_plain_step_ms": [1e3 * s for s in plain_s],
        "round_async_step_ms": [1e3 * s for s in saving_s],
        "round_ratios": ratios,
        "ratio_of_totals": sum(saving_s) / sum(plain_s),
        "ratio": statistics.median(ratios),
        "target_met": statistics.median(ratios) <= 1.05,
        # What one save costs the job (from the step times), and how rarely it may save
        # to stay within 5% at that cost.
        "cost_per_save_ms": 1e3 * cost,
        "every_for_5pct": max(1, math.ceil(cost / (0.05 * statistics.median(plain_s)))),
        # (b), in the job: the devices' idle time per save, the next step's slowdown, both
        # from the workers' spans; their sum, roughly, as the step's later finish.
        "async_idle_ms": 1e3 * statistics.median(spans["idle"]),
        # The idle time alone over the N steps between saves: what the save costs where the
        # background commit does not share the devices' cores (a TPU host).
        "idle_share": statistics.median(spans["idle"]) / (every * statistics.median(plain_s)),
        "next_step_slower_ms": 1e3 * statistics.median(spans["slower"]),
        "save_op_ms": 1e3 * statistics.median(spans["op"]),
        "interval_excess_ms": 1e3 * statistics.median(excess),
        "first_save_excess_ms": 1e3 * statistics.median(first),
        "save_to_commit_ms": 1e3 * statistics.median(latency),
        # (d), the whole machine (both hosts, the controller): CPU per step of the plain
        # job, the share of the cores it keeps busy, and CPU per save beyond the steps'.
        "round_cpu_per_step_ms": [1e3 * c for c in cpu_step],
        "round_cpu_per_save_in_job_ms": [1e3 * c for c in cpu_save],
        "cpu_per_step_ms": 1e3 * statistics.median(cpu_step),
        "cpu_busy_share": statistics.median(busy),
        "cpu_per_save_in_job_ms": 1e3 * statistics.median(cpu_save),
    }


# -- (b) and (c) in this process -------------------------------------------------------


def _job_state(overrides: dict[str, str]) -> list[Any]:
    """Arrays shaped like the state of an LM job with `overrides` (params and optimizer
    state), filled with random values."""
    import jax

    from programs.base import ParallelAxes, get_program, train_layout

    program = get_program("lm")
    mesh = jax.make_mesh((1,), ("data",))
    layout = train_layout(
        program, program.make_config(overrides), mesh, ParallelAxes.for_mesh(mesh)
    )
    rng = np.random.default_rng(0)
    state = []
    for leaf in layout.state:
        if np.issubdtype(leaf.dtype, np.floating):
            value = rng.standard_normal(leaf.shape).astype(leaf.dtype)
        else:
            value = rng.integers(0, 1000, leaf.shape).astype(leaf.dtype)
        state.append(jax.device_put(value))
    return state


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _nbytes(state: Sequence[Any]) -> int:
    return sum(a.nbytes for a in state)


def _host_saves(state: Sequence[Any], directory: Path, saves: int) -> tuple[list[float], ...]:
    """Saves `state` with a HostCheckpointer of this process; per save, the seconds until
    `save` returned (the copy to host memory), until the step committed (what a
    synchronous save blocks), and the CPU seconds this process (all its threads) spent
    on it until then. The first save, which opens orbax's manager, is left out."""
    from worker.checkpoint import HostCheckpointer

    checkpointer = HostCheckpointer(directory)
    returned, committed, cpu = [], [], []
    try:
        for step in range(saves + 1):
            started, cpu_started = time.perf_counter(), time.process_time()
            checkpointer.save(step, list(state), {"step": step})
            back = time.perf_counter() - started
            checkpointer.wait_until_committed(None)
            if step:
                returned.append(back)
                committed.append(time.perf_counter() - started)
                cpu.append(time.process_time() - cpu_started)
    finally:
        checkpointer.close()
    return returned, committed, cpu


class _CpuRecorder:
    """Samples the machine's busy CPU seconds (all cores, /proc/stat) every `interval_s`
    on a thread of its own, while in its `with` block."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self._interval_s = interval_s
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-recorder", daemon=True)

    @staticmethod
    def busy_s() -> float:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        # user nice system idle iowait irq softirq steal (guest time is in user's)
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")

    def _run(self) -> None:
        while True:
            self._samples.append((time.time(), self.busy_s()))
            if self._stop.wait(self._interval_s):
                return

    def __enter__(self) -> _CpuRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> float:
        """Busy CPU seconds between wall times t0 and t1 (both within the block)."""
        return cpu_between(list(self._samples), t0, t1)


def _drop_cached(directory: Path) -> None:
    """Drops the pages of every file under `directory` from the page cache (they are
    on disk: orbax and the raw writer fsync)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _raw_write(arrays: Sequence[np.ndarray], directory: Path) -> float:
    started = time.perf_counter()
    directory.mkdir()
    for i, a in enumerate(arrays):
        with open(directory / str(i), "wb", buffering=0) as f:
            f.write(memoryview(a).cast("B"))
            os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def _raw_read(arrays: Sequence[np.ndarray], directory: Path) -> float:
    into = [np.empty_like(a) for a in arrays]
    started = time.perf_counter()
    for i, a in enumerate(into):
        with open(directory / str(i), "rb", buffering=0) as f:
            view = memoryview(a).cast("B")
            while view:
                view = view[f.readinto(view) :]
    return time.perf_counter() - started


def _throughput(root: Path, nbytes: int, rounds: int) -> dict[str, Any]:
    """(c): per round, orbax save (until committed) and restore vs. raw write + fsync and
    read of the same arrays, each read from the disk; in alternating order."""
    import jax

    from worker.checkpoint import HostCheckpointer

    rng = np.random.default_rng(1)
    host = [rng.standard_normal(nbytes // 8 // 4, dtype=np.float32) for _ in range(8)]
    state = [jax.device_put(a) for a in host]
    target = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in state]
    checkpointer = HostCheckpointer(root / "orbax")
    times: dict[str, list[float]] = {"save": [], "restore": [], "write": [], "read": []}
    try:
        checkpointer.save(0, state, {})  # opens the manager: not measured
        checkpointer.wait_until_committed(None)
        for r in range(rounds):
            for orbax in (True, False) if r % 2 == 0 else (False, True):
                if orbax:
                    started = time.perf_counter()
                    checkpointer.save(r + 1, state, {})
                    checkpointer.wait_until_committed(None)
                    times["save"].append(time.perf_counter() - started)
                    _drop_cached(root / "orbax")
                    started = time.perf_counter()
                    restored, _ = checkpointer.restore(r + 1, target)
                    jax.block_until_ready(restored)
                    times["restore"].append(time.perf_counter() - started)
                    del restored
                else:
                    raw = root / f"raw-{r}"
                    times["write"].append(_raw_write(host, raw))
                    _drop_cached(raw)
                    times["read"].append(_raw_read(host, raw))
                    shutil.rmtree(raw)
    finally:
        checkpointer.close()
        shutil.rmtree(root / "orbax", ignore_errors=True)
    rate = {k: [nbytes / t / 1e6 for t in v] for k, v in times.items()}
    return {
        "bytes": nbytes,
        "arrays": len(host),
        "rounds": rounds,
        "round_mb_per_s": rate,
        "save_mb_per_s": statistics.median(rate["save"]),
        "raw_write_mb_per_s": statistics.median(rate["write"]),
        "restore_mb_per_s": statistics.median(rate["restore"]),
        "raw_read_mb_per_s": statistics.median(rate["read"]),
        "save_ratio": statistics.median(
            s / w for s, w in zip(rate["save"], rate["write"], strict=True)
        ),
        "restore_ratio": statistics.median(
            s / w for s, w in zip(rate["restore"], rate["read"], strict=True)
        ),
    }


def run(quick: bool = False) -> dict[str, Any]:
    import slicewise

    root = Path(tempfile.mkdtemp(prefix="slicewise-bench-checkpoint-"))
    points = []
    try:
        host = {}
        for label, (overrides, _) in CONFIGS.items():
            state = _job_state(overrides)
            returned, committed, cpu = _host_saves(state, root / f"host-{len(host)}", HOST_SAVES)
            host[label] = {
                "state_bytes": _nbytes(state),
                "async_returned_ms": 1e3 * statistics.median(returned),
                "sync_committed_ms": 1e3 * statistics.median(committed),
                "host_save_cpu_ms": 1e3 * statistics.median(cpu),
                "all_returned_ms": [1e3 * t for t in returned],
                "all_committed_ms": [1e3 * t for t in committed],
                "all_host_save_cpu_ms": [1e3 * t for t in cpu],
            }
            shutil.rmtree(root / f"host-{len(host) - 1}", ignore_errors=True)
        io = _throughput(root, IO_BYTES // 4 if quick else IO_BYTES, 1 if quick else IO_ROUNDS)
        with (
            sim_controller(SIM) as controller,
            slicewise.connect(controller.address) as client,
            client.allocate(slices=SLICES, slice_type=SLICE_TYPE, timeout=300) as gang,
            _CpuRecorder() as cpu,
        ):
            # Compiles, and waits out the stir a new gang causes (see train_overhead).
            settle = next(iter(CONFIGS.values()))[0]
            settled = time.monotonic() + (5 if quick else SETTLE_S)
            while time.monotonic() < settled:
                run_job(client, 40, overrides=settle, gang=gang, checkpoint_every=0)
            for label, (overrides, intervals) in CONFIGS.items():
                for every, (n, rounds) in intervals.items():
                    if quick:  # whole intervals, as few as make a measurement
                        n, rounds = max(every, n // 3 // every * every), 1
                    point = _measure_jobs(
                        client, gang, root, cpu, label, overrides, every, n, rounds
                    )
                    # (d): what one save's CPU, on every host, adds to `every` steps'.
                    save_cpu_ms = HOSTS * host[label]["host_save_cpu_ms"]
                    bound = cpu_bound(save_cpu_ms, point["cpu_per_step_ms"], every)
                    points.append(point | host[label] | {"cpu_bound_ratio": bound})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "config": {
            "sim": SIM,
            "slices": SLICES,
            "mesh": "data over the slices (DCN)",
            "same_gang": True,
            "settle_s": SETTLE_S,
            "host_saves": HOST_SAVES,
            "cores": os.cpu_count(),
            "filesystem": "the one under " + tempfile.gettempdir(),
            "quick": quick,
        },
        "points": points,
        "io": io,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    points, io = result["points"], result["io"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.8))
    x = np.arange(len(points))
    labels = [f"{p['step']}, N={p['checkpoint_every']}\n{_mib(p['state_bytes'])}" for p in points]
    a.bar(
        x - 0.2, [p["plain_step_ms"] for p in points], 0.4, label="no checkpoints", color="tab:gray"
    )
    a.bar(
        x + 0.2,
        [p["async_step_ms"] for p in points],
        0.4,
        label="async save every N",
        color="tab:blue",
    )
    a.scatter(
        x + 0.2,
        [p["plain_step_ms"] * p["cpu_bound_ratio"] for p in points],
        marker="_",
        s=400,
        color="black",
        label="bound by the saves' CPU on saturated cores",
        zorder=3,
    )
    for i, p in enumerate(points):
        top = max(p["async_step_ms"], p["plain_step_ms"] * p["cpu_bound_ratio"])
        a.text(i + 0.2, 1.02 * top, f"{p['ratio']:.3f}x", ha="center", va="bottom")
    a.set_ylim(top=1.45 * max(p["async_step_ms"] for p in points))  # room for the legend
    a.set_xticks(x, labels, fontsize=8)
    a.set_ylabel("ms per step (median round)")
    a.set_title("(a) step time, same gang, alternating rounds")
    a.legend(fontsize=8, loc="upper left")

    idle = [p["async_idle_ms"] for p in points]
    b.bar(x - 0.3, idle, 0.2, label="async: devices idle (job)", color="tab:blue")
    b.bar(
        x - 0.3,
        [p["next_step_slower_ms"] for p in points],
        0.2,
        bottom=idle,
        label="async: next step slower (job)",
        color="lightsteelblue",
    )
    bars = [
        ("async: the save thread's copy (this process)", "async_returned_ms", "tab:cyan"),
        ("sync: save until committed (this process)", "sync_committed_ms", "tab:red"),
        ("save to commit (job)", "save_to_commit_ms", "tab:orange"),
    ]
    for j, (name, key, color) in enumerate(bars):
        b.bar(x + (j - 0.5) * 0.2, [p[key] for p in points], 0.2, label=name, color=color)
    tallest = max(p[k] for p in points for k in ("sync_committed_ms", "save_to_commit_ms"))
    b.set_ylim(top=1.7 * tallest)  # room for the legend
    b.set_xticks(x, labels, fontsize=8)
    b.set_ylabel("ms per save (median)")
    b.set_title("(b) training blocked per save")
    b.legend(fontsize=8)

    pairs = [
        ("save vs raw write+fsync", "save_mb_per_s", "raw_write_mb_per_s", "save_ratio"),
        ("restore vs raw read", "restore_mb_per_s", "raw_read_mb_per_s", "restore_ratio"),
    ]
    for i, (_, ours, raw, ratio) in enumerate(pairs):
        c.bar(i - 0.2, io[ours], 0.4, color="tab:blue", label="orbax" if i == 0 else None)
        c.bar(i + 0.2, io[raw], 0.4, color="tab:gray", label="raw file I/O" if i == 0 else None)
        c.text(i - 0.2, io[ours], f"{io[ratio]:.2f}x", ha="center", va="bottom")
    c.set_ylim(top=1.3 * max(io[k] for _, *keys, _ in pairs for k in keys))
    c.set_xticks([0, 1], [name for name, *_ in pairs])
    c.set_ylabel("MB/s (median round)")
    c.set_title(f"(c) {size_label(io['bytes'])}, cold page cache")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict[str, Any]) -> str:
    lines = []
    for p in result["points"]:
        rounds = ", ".join(f"{r:.3f}" for r in p["round_ratios"])
        lines.append(
            f"(a) step {p['step']} ({_mib(p['state_bytes'])} state, async save every "
            f"{p['checkpoint_every']}): no checkpoints {p['plain_step_ms']:.1f} ms/step, with "
            f"{p['async_step_ms']:.1f} ms/step; ratio {p['ratio']:.3f} (median round; rounds "
            f"{rounds}); target <= 1.05 {'met' if p['target_met'] else 'MISSED'}; that is "
            f"{p['cost_per_save_ms']:.0f} ms per save, within 5% from a save every "
            f"{p['every_for_5pct']} steps"
        )
        lines.append(
            f"(b) step {p['step']}, every {p['checkpoint_every']}: blocked per async save in "
            "the job: devices idle "
            f"{p['async_idle_ms']:.1f} ms ({100 * p['idle_share']:.1f}% of {p['checkpoint_every']} "
            f"steps), and the next step {p['next_step_slower_ms']:.1f} ms "
            f"slower (median of {p['saves_measured']} saves; it finished "
            f"{p['interval_excess_ms']:.0f} ms late; the first save of a job "
            f"{p['first_save_excess_ms']:.0f} ms); vs sync, save until committed "
            f"{p['sync_committed_ms']:.1f} ms (this process, same state; its save() returned "
            f"in {p['async_returned_ms']:.1f} ms); save to commit in the job "
            f"{p['save_to_commit_ms']:.0f} ms; the SaveOp held the executor "
            f"{p['save_op_ms']:.1f} ms"
        )
        lines.append(
            f"(d) step {p['step']}, every {p['checkpoint_every']}: without saves the cores are "
            f"{100 * p['cpu_busy_share']:.0f}% busy, {p['cpu_per_step_ms']:.0f} ms CPU per step "
            f"(whole machine); a save {p['host_save_cpu_ms']:.0f} ms CPU per host until "
            f"committed (this process), x{HOSTS} hosts: on saturated cores the ratio is at "
            f"least {p['cpu_bound_ratio']:.3f}; in the job a save took "
            f"{p['cpu_per_save_in_job_ms']:.0f} ms CPU beyond the steps' (rounds "
            + ", ".join(f"{v:.0f}" for v in p["round_cpu_per_save_in_job_ms"])
            + ")"
        )
    io = result["io"]
    rounds = io["round_mb_per_s"]
    lines.append(
        f"(c) {size_label(io['bytes'])}: save (until committed) {io['save_mb_per_s']:.0f} MB/s "
        f"vs raw write+fsync {io['raw_write_mb_per_s']:.0f} MB/s, ratio {io['save_ratio']:.2f}; "
        f"restore {io['restore_mb_per_s']:.0f} MB/s vs raw read {io['raw_read_mb_per_s']:.0f} "
        f"MB/s, ratio {io['restore_ratio']:.2f} (median rounds; save "
        + ", ".join(f"{v:.0f}" for v in rounds["save"])
        + " / write "
        + ", ".join(f"{v:.0f}" for v in rounds["write"])
        + "; restore "
        + ", ".join(f"{v:.0f}" for v in rounds["restore"])
        + " / read "
        + ", ".join(f"{v:.0f}" for v in rounds["read"])
        + ")"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    result = run(parser.parse_args().quick)
    print(report(result))
    print(write_result("checkpoint", result, plot))


if __name__ == "__main__":
    main()
