"""Faults made routine: a training job's goodput under a random fault every 2 minutes.

For half an hour a training job meets a random fault every few minutes, and its goodput
is what is left. Targets: goodput >= 95%, every fault survived, every loss identical to
an uninterrupted run's, no process left behind.

`slicewise bench soak [--minutes 30] [--every 2] [--seed 0]`: an `lm` job (the recovery
benchmark's config, ~0.2 s steps here) on 2 x v5litepod-4 of a simulated 3 x
v5litepod-4 cluster, with default flags (peer recovery, a checkpoint every 50 steps). Every
`--every` minutes a fault drawn at random from kill-worker, remove-host, hang-collective
and kill-controller hits a random host of the job at a random step (1 to 25 steps after
the draw). The cluster runs in a process of its own (`SimulationProcess`) and the
controller joins it with `--ray-address`, as on TPU VMs, where Ray outlives the
controller (with `--compilation-cache`, where the workers keep their compiled
programs); this process stands in for the supervisor that starts a killed controller
again, at once, on the same state directory and port, and for the cloud that replaces a
removed host's VM (the host comes back once the job trains again, so that the next
removal also finds a spare slice). After `--minutes` the job is cancelled, and the same
job runs again without faults for as many steps: the reference, whose losses every step
of the soak must equal bit for bit, and whose goodput is the ceiling without faults. The
whole run takes about twice `--minutes`.

Goodput is productive step time over wall time, as ByteRobust's ETTR and MaxText's
ml-goodput-measurement count it: the time in which a kept step was running (by the
steps' own times, measured on the worker; steps in flight counted once) over the time
from the job's submission to its last step. The first step after a fault runs beside
the recovery's last work and is slower than the rest; the goodput with each such step
held to the median step's time is reported beside it, and the target is met only if
both reach it. The badput is split
into the buckets ml-goodput-measurement uses, per fault from the job's recovery records
and the controller's log (as `slicewise bench recovery` splits a recovery): detection
(fault to the gang failing), controller restart (kill-controller: the process gone until
the new one took the job up), new gang (the failed gang released, a new one up), restore
(programs loaded, state from a peer's replica or the checkpoint), program compile (the
first step's wait for its program), progress lost (steps run again, at the median step
time), startup (submission to the first step), and other (the rest: time between steps,
checkpoint saves, a host's repair). Writes results/soak.json and results/soak.png.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.recovery import (
    ENDED,
    SIM,
    SLICE_TYPE,
    SLICES,
    _Controller,
    first_event,
    phases,
)
from controller.chaos import KINDS
from controller.simcluster import _session_processes
from programs.lm.config import SMALL_OVERRIDES
from protos import controller_pb2 as pb

MINUTES, EVERY_MIN = 30.0, 2.0
QUICK_MINUTES, QUICK_EVERY_MIN = 4.0, 1.0
BUDGET = 1_000_000  # the job's --steps: it is cancelled long before
CONFIG = SMALL_OVERRIDES | {"total_steps": str(BUDGET), "seed": "3"}
TARGET_GOODPUT = 0.95
STEP_OFFSETS = (1, 25)  # a fault hits this many steps after it is drawn
RECOVER_TIMEOUT_S = 240.0  # a fault the job has not trained after in this long: not survived
BUCKETS = (
    "detection",
    "controller restart",
    "new gang",
    "restore",
    "program compile",
    "progress lost",
    "startup",
    "other",
)


# -- pure parts: the plan, the accounting, the comparison ------------------------------


@dataclass(frozen=True)
class PlannedFault:
    """A fault of the soak: `kind` on jax.distributed process `process`, drawn `due_s`
    after the job's submission, hitting `offset` steps after the step the job is at."""

    due_s: float
    kind: str
    process: int
    offset: int


def plan_faults(
    seed: int, minutes: float, every_min: float, num_processes: int
) -> list[PlannedFault]:
    """One fault every `every_min` minutes that begins before `minutes` are over, each
    drawn from `KINDS` with its host and step offset by a generator seeded with `seed`."""
    if minutes <= 0 or every_min <= 0:
        raise ValueError(f"--minutes and --every must be > 0, got {minutes:g} and {every_min:g}")
    rng = random.Random(seed)
    plan = []
    due = every_min * 60.0
    while due < minutes * 60.0:
        plan.append(
            PlannedFault(
                due,
                rng.choice(KINDS),
                rng.randrange(num_processes),
                rng.randint(*STEP_OFFSETS),
            )
        )
        due += every_min * 60.0
    return plan


def busy_time(steps: Sequence[tuple[float, float]]) -> float:
    """Seconds in which some step was running: the union of the intervals
    [end - own time, end] of `steps` ((end, own time) pairs). Steps in flight overlap,
    so their own times summed would count some seconds twice."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted((end - own, end) for end, own in steps):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def account(
    steps: Sequence[tuple[float, float]],
    faults: Sequence[dict[str, Any]],
    wall_s: float,
    startup_s: float,
) -> dict[str, Any]:
    """Goodput and its badput by bucket.

    Args:
        steps: (end, own time) of every step the job kept, once each; productive time is
            the time in which one of them was running (`busy_time`).
        faults: per fault, `steps_lost` and `phases_s` (detect, controller restart,
            release, new gang, restore, first step) and `first_step_time_s`.
        wall_s: from the job's submission to its last step.
        startup_s: from the submission to the first step.
    """
    productive = busy_time(steps)
    median_step = statistics.median(own for _, own in steps) if steps else 0.0
    buckets = dict.fromkeys(BUCKETS, 0.0)
    for f in faults:
        split = f.get("phases_s") or {}
        buckets["detection"] += split.get("detect") or 0.0
        buckets["controller restart"] += split.get("controller restart") or 0.0
        buckets["new gang"] += (split.get("release") or 0.0) + (split.get("new gang") or 0.0)
        buckets["restore"] += split.get("restore") or 0.0
        first = split.get("first step")
        if first is not None:
            buckets["program compile"] += max(0.0, first - (f.get("first_step_time_s") or 0.0))
        buckets["progress lost"] += (f.get("steps_lost") or 0) * median_step
    buckets["startup"] = startup_s
    buckets["other"] = wall_s - productive - sum(buckets.values())
    # The first step after a fault runs beside the recovery's last work (stash actors
    # starting, a first call's one-time setup) and takes longer than the others; its
    # time is the step's own, so it counts as productive above. The same goodput with
    # each such step held to the median step's time, for a reader who would count the
    # excess as the fault's:
    excess = sum(max(0.0, (f.get("first_step_time_s") or 0.0) - median_step) for f in faults)
    return {
        "goodput": productive / wall_s if wall_s > 0 else 0.0,
        "productive_s": productive,
        "wall_s": wall_s,
        "median_step_s": median_step,
        "badput_s": buckets,
        "first_steps_excess_s": excess,
        "goodput_first_steps_at_median": (productive - excess) / wall_s if wall_s > 0 else 0.0,
    }


def compare_losses(
    soak: dict[int, float], reference: dict[int, float]
) -> tuple[bool, list[tuple[int, float, float | None]]]:
    """Whether every step of the soak has the reference's loss bit for bit, and the steps
    that do not (step, soak's loss, reference's or None where it has none; at most 10)."""
    differ = [
        (step, loss, reference.get(step))
        for step, loss in sorted(soak.items())
        if reference.get(step) != loss
    ]
    return not differ and bool(soak), differ[:10]


def processes_in_sessions(sessions: Sequence[int]) -> int:
    """How many processes of these sessions are alive (this one aside)."""
    return sum(len(_session_processes(sid)) for sid in sessions)


_RESUMES = re.compile(r"job \S+ resumes after .* \(step (\d+) recorded")


# -- the soak ----------------------------------------------------------------------------


def _wait(what: str, ready: Callable[[], Any], timeout_s: float, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := ready()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(interval_s)
    return value


class _Soak:
    """One soak: the cluster, the controller (started again after kill-controller), a
    client of it, and the job."""

    def __init__(self, root: Path) -> None:
        import slicewise
        from controller.simcluster import SimulationProcess

        self.root = root
        self.connect = lambda address: slicewise.connect(address, name="bench-soak")
        self.cluster = SimulationProcess(SIM)
        self.sessions = [self.cluster.pid]
        self.ctl = _Controller(
            root / "controller", ray_address=self.cluster.address, env=self.cluster.ray_env()
        )
        # Where the workers keep compiled programs, as a deployment gives it: a controller
        # joined to a cluster has none unless told (with --sim, <state-dir>/jax-cache).
        self.ctl.extra_args += ("--compilation-cache", str(root / "jax-cache"))
        self.client: Any = None

    def start(self) -> None:
        self.ctl.start()
        self.sessions = [self.cluster.pid, *self.ctl.sessions]
        self.client = self.connect(self.ctl.proc.address)

    def close(self) -> int:
        """Stops everything; returns how many of its processes are still alive."""
        if self.client is not None:
            self.client.close()
        self.ctl.close()
        self.cluster.stop()
        self.sessions = [self.cluster.pid, *self.ctl.sessions]
        return processes_in_sessions(self.sessions)

    def submit(self, steps: int, directory: Path, max_failures: int) -> str:
        return self.client.submit_job(
            "lm",
            slices=SLICES,
            slice_type=SLICE_TYPE,
            steps=steps,
            overrides=CONFIG,
            checkpoint_dir=str(directory),
            max_failures=max_failures,
        ).job_id

    def info(self, job_id: str) -> pb.JobInfo:
        return self.client.job(job_id)

    def running_at(self, job_id: str, step: int) -> pb.JobInfo | None:
        """The job's info once it has completed `step` steps and runs; raises if it ended."""
        info = self.info(job_id)
        if info.state in ENDED:
            raise RuntimeError(f"job {job_id} ended ({pb.JobState.Name(info.state)}): {info.error}")
        return info if info.step >= step and info.state == pb.JOB_STATE_RUNNING else None

    def host(self, info: pb.JobInfo, process: int) -> tuple[str, str]:
        """(slice name, words) of the job's jax.distributed process `process`."""
        gang = next(g for g in self.client.cluster_info().gangs if g.gang_id == info.gang_id)
        name = gang.slices[process]  # v5litepod-4: one host per slice
        return name, f"host 0 of slice {name}"

    # One fault each; every one returns the fault's record.

    def recovered(
        self, job_id: str, before: int, fault_at: float | None, kind: str, at_step: int, host: str
    ) -> dict[str, Any]:
        """The record of a fault the job recovers from by itself: waits for the first
        recovery after the `before` it had, and for a step after it."""

        def settled() -> pb.JobInfo | None:
            info = self.info(job_id)
            if info.state in ENDED or any(r.resumed_at for r in info.recoveries[before:]):
                return info
            return None

        info = _wait(f"a recovery of job {job_id} from {kind}", settled, RECOVER_TIMEOUT_S)
        new = info.recoveries[before:]
        if not new or not any(r.resumed_at for r in new):
            return {
                "kind": kind,
                "at_step": at_step,
                "host": host,
                "survived": False,
                "cause": info.error,
            }
        r = new[0]
        resumed_at = next(x.resumed_at for x in new if x.resumed_at)
        fault_at = fault_at if fault_at is not None else r.fault_at
        records = self.client.job_metrics(job_id).steps
        first = next((x for x in records if x.step == new[-1].resumed_from_step), None)
        split = {"detect": r.detected_at - fault_at, "controller restart": 0.0}
        split |= phases(self.ctl.events(), job_id, r.detected_at, resumed_at)
        return {
            "kind": kind,
            "at_step": at_step,
            "host": host,
            "detect_s": r.detected_at - fault_at,
            "to_first_step_s": resumed_at - fault_at,
            "steps_lost": sum(x.steps_lost for x in new),
            "survived": True,
            "source": r.source,
            "cause": r.cause,
            "recoveries": len(new),
            "fault_at": fault_at,
            "phases_s": split,
            "first_step_time_s": first.step_time_s if first else None,
        }

    def chaos(self, job_id: str, fault: PlannedFault, at_step: int) -> dict[str, Any]:
        """kill-worker or hang-collective, fired by the controller at `at_step`."""
        info = self.info(job_id)
        _, host = self.host(info, fault.process)
        self.client.inject_fault(job_id, fault.kind, at_step=at_step, process=fault.process)
        return self.recovered(job_id, len(info.recoveries), None, fault.kind, at_step, host)

    def remove_host(self, job_id: str, fault: PlannedFault, at_step: int) -> dict[str, Any]:
        """The host's VM goes away at `at_step`; once the job trains again, it comes back."""
        info = _wait(f"step {at_step}", lambda: self.running_at(job_id, at_step), 600, 0.01)
        name, host = self.host(info, fault.process)
        fault_at = time.time()
        self.cluster.remove_host(name, 0)
        record = self.recovered(job_id, len(info.recoveries), fault_at, fault.kind, at_step, host)
        self.cluster.add_host(name, 0)
        return record

    def kill_controller(self, job_id: str, fault: PlannedFault, at_step: int) -> dict[str, Any]:
        """The controller SIGKILLs itself at `at_step` and is started again at once."""
        _wait(f"step {at_step}", lambda: self.running_at(job_id, at_step), 600, 0.01)
        asked = time.time()
        self.client.inject_fault(job_id, "kill-controller")
        self.ctl.proc.proc.wait(timeout=60)
        gone = time.time()
        self.client.close()
        self.start()
        records = _wait(
            f"a step of job {job_id} after the controller restarted",
            lambda: [x for x in self.client.job_metrics(job_id).steps if x.wall_time > gone],
            RECOVER_TIMEOUT_S,
            0.1,
        )
        first = min(records, key=lambda x: x.wall_time)
        info = self.info(job_id)
        events = self.ctl.events()
        recorded = next(
            (
                int(m.group(1))
                for _, msg in events
                if (m := _RESUMES.search(msg)) and m.group(0).startswith(f"job {job_id}")
            ),
            None,
        )
        taken_up = first_event(events, gone, rf"^job {job_id} resumes after") or gone
        split = {"detect": gone - asked, "controller restart": taken_up - gone}
        split |= phases(events, job_id, taken_up, first.wall_time)
        resumed = info.resumed_from_step
        return {
            "kind": "kill-controller",
            "at_step": at_step,
            "host": "the controller",
            "detect_s": gone - asked,
            "to_first_step_s": first.wall_time - asked,
            "steps_lost": None if recorded is None else max(0, recorded - resumed),
            "survived": info.state == pb.JOB_STATE_RUNNING,
            "source": "checkpoint",
            "cause": "the controller was SIGKILLed and started again",
            "recoveries": 0,
            "fault_at": asked,
            "phases_s": split,
            "first_step_time_s": first.step_time_s,
        }

    def fire(self, job_id: str, fault: PlannedFault) -> dict[str, Any]:
        info = _wait("the job to run", lambda: self.running_at(job_id, 1), RECOVER_TIMEOUT_S)
        at_step = info.step + fault.offset
        if fault.kind in ("kill-worker", "hang-collective"):
            return self.chaos(job_id, fault, at_step)
        if fault.kind == "remove-host":
            return self.remove_host(job_id, fault, at_step)
        return self.kill_controller(job_id, fault, at_step)


def _losses(records: Sequence[Any]) -> dict[int, float]:
    return {r.step: r.loss for r in records}


def run(quick: bool = False, args: argparse.Namespace | None = None) -> dict[str, Any]:
    minutes = getattr(args, "minutes", None) or (QUICK_MINUTES if quick else MINUTES)
    every = getattr(args, "every", None) or (QUICK_EVERY_MIN if quick else EVERY_MIN)
    seed = getattr(args, "seed", 0) or 0
    plan = plan_faults(seed, minutes, every, SLICES)
    root = Path(tempfile.mkdtemp(prefix="slicewise-bench-soak-"))
    print(
        f"   {len(plan)} faults over {minutes:g} min (seed {seed}); controller logs and "
        f"checkpoints under {root}",
        flush=True,
    )
    soak = _Soak(root)
    faults: list[dict[str, Any]] = []
    try:
        soak.start()
        submitted = time.time()
        job_id = soak.submit(BUDGET, root / "soak", max_failures=10 * len(plan) + 10)
        for n, fault in enumerate(plan):
            delay = submitted + fault.due_s - time.time()
            if delay > 0:
                time.sleep(delay)
            record = soak.fire(job_id, fault)
            faults.append(record)
            print(f"   fault {n + 1}/{len(plan)}: {_line(record)}", flush=True)
            if not record["survived"]:
                break
        delay = submitted + minutes * 60.0 - time.time()
        if delay > 0:
            time.sleep(delay)
        info = soak.info(job_id)
        if info.state not in ENDED:
            soak.client.cancel_job(job_id)
        _wait(f"job {job_id} to end", lambda: soak.info(job_id).state in ENDED, 120)
        records = sorted(soak.client.job_metrics(job_id).steps, key=lambda r: r.step)
        wall = records[-1].wall_time - submitted
        print(f"   soak over at step {records[-1].step}; the reference runs as many", flush=True)
        started = time.time()
        ref_id = soak.submit(records[-1].step + 1, root / "reference", max_failures=3)
        _wait(
            f"reference job {ref_id} to end",
            lambda: soak.info(ref_id).state in ENDED,
            wall + 600,
            0.5,
        )
        ref = soak.info(ref_id)
        reference = sorted(soak.client.job_metrics(ref_id).steps, key=lambda r: r.step)
        if ref.state != pb.JOB_STATE_SUCCEEDED:
            raise RuntimeError(f"the reference job {ref_id} did not succeed: {ref.error}")
    finally:
        processes_left = soak.close()
    identical, differ = compare_losses(_losses(records), _losses(reference))
    figures = account(
        [(r.wall_time, r.step_time_s) for r in records],
        [f for f in faults if f["survived"]],
        wall,
        records[0].wall_time - submitted,
    )
    ceiling = account(
        [(r.wall_time, r.step_time_s) for r in reference],
        [],
        reference[-1].wall_time - started,
        reference[0].wall_time - started,
    )
    return {
        "config": {
            "sim": SIM,
            "job": f"lm on {SLICES} x {SLICE_TYPE}, data parallel over the DCN, default flags",
            "lm_config": CONFIG,
            "every_min": every,
            "seed": seed,
            "kinds": list(KINDS),
            "target_goodput": TARGET_GOODPUT,
            "cores": os.cpu_count(),
            "quick": quick,
        },
        "goodput": figures["goodput"],
        "minutes": minutes,
        "losses_identical": identical,
        "processes_left": processes_left,
        "faults": faults,
        "all_survived": all(f["survived"] for f in faults) and len(faults) == len(plan),
        "steps": len(records),
        "losses_differ": differ,
        "accounting": figures,
        "reference": {"job": ref_id, "goodput": ceiling["goodput"], "accounting": ceiling},
        "step_times": [[r.wall_time - submitted, r.step_time_s] for r in records],
        "submitted_at": submitted,
        "job": job_id,
        "root": str(root),
    }


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "?" if v is None else format(v, spec)


def _line(f: dict[str, Any]) -> str:
    if not f["survived"]:
        return f"{f['kind']} at step {f['at_step']} on {f['host']}: NOT survived ({f.get('cause')})"
    return (
        f"{f['kind']} at step {f['at_step']} on {f['host']}: detected in "
        f"{_fmt(f['detect_s'])} s, first step {_fmt(f['to_first_step_s'])} s after, "
        f"{_fmt(f['steps_lost'], 'd')} steps lost ({f['source']})"
    )


def report(result: dict[str, Any]) -> str:
    acc = result["accounting"]
    strict = acc.get("goodput_first_steps_at_median", result["goodput"])
    lines = [
        f"goodput {result['goodput']:.1%} over {result['minutes']:g} min "
        f"({strict:.1%} with the first step after each fault held to the median step; "
        f"target >= {TARGET_GOODPUT:.0%}: "
        + ("met" if min(result["goodput"], strict) >= TARGET_GOODPUT else "MISSED")
        + f"); without faults {result['reference']['goodput']:.1%}",
        f"{len(result['faults'])} faults, "
        + ("all survived" if result["all_survived"] else "NOT all survived")
        + f"; losses identical to the reference: {result['losses_identical']}"
        + f" ({result['steps']} steps); processes left: {result['processes_left']}",
        "badput (s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in acc["badput_s"].items())
        + f"; productive {acc['productive_s']:.1f} of {acc['wall_s']:.1f}",
        f"{'fault':<17}{'step':>7}  {'host':<30}{'detect':>8}{'->1st step':>11}{'lost':>6}",
    ]
    for f in result["faults"]:
        lines.append(
            f"{f['kind']:<17}{f['at_step']:>7}  {f['host']:<30}{_fmt(f.get('detect_s')):>7}s"
            f"{_fmt(f.get('to_first_step_s')):>10}s{_fmt(f.get('steps_lost'), 'd'):>6}"
            + ("" if f["survived"] else "  NOT survived")
        )
    for kind in KINDS:
        of = [f for f in result["faults"] if f["kind"] == kind and f["survived"]]
        if of:
            lines.append(
                f"  {kind}: median detect {statistics.median(f['detect_s'] for f in of):.2f} s, "
                f"fault -> first step {statistics.median(f['to_first_step_s'] for f in of):.2f} s"
                f" ({len(of)})"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    times = np.array(result["step_times"])
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.plot(
        times[:, 0] / 60.0,
        times[:, 1] * 1000.0,
        ".",
        markersize=2,
        color="tab:blue",
        label="step time (on the worker)",
    )
    colors = dict(zip(KINDS, ("tab:red", "tab:purple", "tab:orange", "tab:green"), strict=True))
    for f in result["faults"]:
        if f.get("fault_at"):
            x = (f["fault_at"] - result["submitted_at"]) / 60.0
            ax.axvline(x, color=colors[f["kind"]], alpha=0.7, linewidth=1)
    for kind, color in colors.items():
        ax.plot([], [], color=color, label=kind)
    ax.set_yscale("log")
    ax.set_xlabel("minutes since the job was submitted")
    ax.set_ylabel("step time (ms)")
    ax.set_title(
        f"Soak: lm on {SLICES} x {SLICE_TYPE}, a fault every {result['config']['every_min']:g} "
        f"min (vertical lines); goodput {result['goodput']:.1%} (without faults "
        f"{result['reference']['goodput']:.1%}), losses identical: "
        f"{result['losses_identical']}",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper right", ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, help=f"soak: how long (default {MINUTES:g})")
    parser.add_argument(
        "--every", type=float, help=f"soak: minutes between faults (default {EVERY_MIN:g})"
    )
    parser.add_argument("--seed", type=int, default=0, help="soak: the faults' seed (default 0)")
