"""Recovery from faults: how long a training job takes to train again after a fault it
recovers from by itself, vs. a plain restart of the same job from its checkpoint.
Target: fault to first resumed step <= 10 s.

A 2 x v5litepod-4 `lm` job of 30 steps (data parallel over the DCN, a checkpoint every
10 steps) meets a fault once step 15 is done, mid-way between two checkpoints:
kill-worker (one host's worker SIGKILLed), remove-host (the simulated host goes away,
raylet and all; the simulation, 3 x v5litepod-4, has a spare slice for the job to move
to), hang-collective (one host's executor stops before a step while the other waits in
its collectives) or kill-controller (the controller SIGKILLs itself and this process
starts it again at once on the same state directory and port). The job, with default
flags, recovers by itself from the first three (RECOVERING, a new gang, the surviving
slice's replica of the step reached, or the newest committed step when no replica
survives); the fourth it continues once the new controller is up. Right after each
faulted job ends, the baseline: what a user without recovery does, submit the same job
again on its checkpoint directory (with 2 more steps than it holds, so that there is
something to do), which restores the newest committed step and trains on.

A round is kill-worker and remove-host (in alternating order) on one controller with
--sim, which is then stopped and started again (a fresh simulation brings the spare
slice back for the next round); the hang rounds run on a second controller; the
kill-controller rounds on a third, joined with --ray-address to a simulated cluster
this process runs, as a controller on TPU VMs joins a Ray cluster that outlives it
(with --sim the simulation would go with the controller and start anew, ~6.5 s more
here). Then the same without a spare, on warm hosts: kill-worker and hang-collective on
a controller whose simulation has exactly the job's two slices, so that the new gang
is the old one's hosts ("no spare" in the results). Every controller has the default
flags. 3 rounds, 1 with --quick.

How each figure is obtained (all times on this machine's clock; the workers run on it):

- detect: for the first three, the job's `Recovery` record (`client.job(...).recoveries`):
  `detected_at` (the gang failed) - `fault_at`. `fault_at` is when the fault was
  injected (kill-worker, remove-host), or, for a hang, when the hung host stopped
  completing work (by its heartbeat). For kill-controller: from when this process asked
  for the fault (`inject_fault`, now, once the job is past step 15) until the
  controller process is gone (`wait()` returns; it kills itself 0.2 s after the
  request is answered). Nothing restarts a dead controller here but this benchmark, at
  once: on a cluster that is a supervisor's job.
- fault -> first step: `resumed_at` (the first step after the recovery finished, by the
  worker's clock) - `fault_at`. For kill-controller: the `wall_time` of the first step
  the job recorded after the new controller was up (`job_metrics`) - the request.
- steps lost: the record's `steps_lost` (steps done when the failure was detected minus
  the step resumed from). For kill-controller: the steps the journal held when the new
  controller started ("step N recorded" in its log) minus `resumed_from_step`.
- plain restart: from `submit_job` until the `wall_time` of the new job's first step.
  Ratio = fault -> first step / plain restart of the same round; the median round's
  ratio is reported.
- Where the time goes, from the controller's log (millisecond timestamps): detect (as
  above), release (until "gang gN: released": the failed gang let go, its workers
  stopped; the job asks for a new gang only then), new gang (until "gang gM ready": a
  gang of new workers, their jax.distributed cluster), restore (until "job J running":
  exporting and loading the programs, restoring the checkpoint), first step (until the
  first step finished: the new workers wait for the step program they began compiling
  when it was loaded, then run it; its own `step_time_s` is kept too).
  kill-controller has "controller restart" instead of release: from the old process
  gone until the new one takes the job up ("job J resumes after the controller
  restarted", just before it listens). Its controller has --compilation-cache (with
  --sim the default is under the state directory; joined to a cluster, none). The
  plain restart splits the same way from its submission.
- remove-host's `fault_at` is the request; the simulation takes a moment more (0.1 to
  0.8 s in our runs) to take the raylet down with the worker on it (steps go on
  meanwhile), and the closed channel is noticed at once: its "detect" is mostly that.
- The hang is detected by the watchdog when the hung host has stayed a step behind
  its peers, which wait for it in the next step's collectives, for the gang's lag
  deadline: 3x the job's slowest step so far, at least 2 s (controller/health.py).
  Steps here take ~0.1-0.3 s, so the floor decides. Detection of a hang is bounded
  below by that deadline; the deadline the job had is reported next to it (from its
  slowest step before the step it resumed from: those steps are not run again, their
  records stay). Time a host spends compiling, and the others waiting for it, is no
  stall (the controller tracks it from the heartbeats). Should a healthy gang still
  fail (listed as `spurious`), every job may fail 6 times (not the default 3); a
  faulted job's injected recovery is the first one after the checkpoint of step 10,
  and its first step after the fault is counted however many tries it took; a plain
  restart that failed so is made again.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import write_result
from controller.health import LAG_FLOOR_S, lag_deadline
from controller.simcluster import SimulationProcess
from programs.lm.config import SMALL_OVERRIDES
from protos import controller_pb2 as pb
from slicewise.launch import RestartableController

SIM = "3xv5litepod-4"  # two slices for the job, a spare for remove-host
WARM_SIM = "2xv5litepod-4"  # the job's two slices and no spare: a new gang is the old hosts
SLICES, SLICE_TYPE = 2, "v5litepod-4"
STEPS, EVERY, AT = 30, 10, 15
TARGET_S = 10.0
ROUNDS = 3
KINDS = ("kill-worker", "remove-host", "hang-collective", "kill-controller")
NO_SPARE = ", no spare"  # the label of a kind's runs on warm hosts
WARM_KINDS = ("kill-worker", "hang-collective")
LABELS = (*KINDS, *(k + NO_SPARE for k in WARM_KINDS))
# The LM config of the recovery tests (tests/integration/test_checkpoints.py): steps of
# ~0.1-0.2 s here.
CONFIG = SMALL_OVERRIDES | {"total_steps": "40", "seed": "3"}
ENDED = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)
PHASES = ("detect", "controller restart", "release", "new gang", "restore", "first step")


# -- the controller's log: pure parsing ------------------------------------------------

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) [A-Z]+ [\w.]+: (.*)$")


def log_events(text: str) -> list[tuple[float, str]]:
    """(time.time(), message) of every line of a controller log (local time, ms)."""
    events = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            events.append((when, m.group(2)))
    return events


def first_event(events: Sequence[tuple[float, str]], after: float, pattern: str) -> float | None:
    """When the first message matching `pattern` was logged at or after `after` (the
    log's times are cut to the millisecond: `after` is too)."""
    compiled = re.compile(pattern)
    after = int(after * 1000) / 1000
    return next((t for t, msg in events if t >= after - 1e-6 and compiled.search(msg)), None)


def phases(
    events: Sequence[tuple[float, str]], job_id: str, start: float, first_step: float
) -> dict[str, float | None]:
    """release, new gang, restore and first step of a job that (re)starts at `start`:
    until its failed gang was released (0 where none failed), until its new gang was
    ready, until it ran (programs loaded, checkpoint restored), until its first step
    finished."""
    released = first_event(
        events,
        start,
        rf"^gang g\d+-[a-z2-7]+: released: gang g\d+-[a-z2-7]+ failed under job {job_id},",
    )
    ready = first_event(events, released or start, rf"gang g\d+-[a-z2-7]+ ready:.*\bjob={job_id}\]")
    running = first_event(events, ready or start, rf"^job {job_id} running:")
    return {
        "release": 0.0 if released is None else released - start,
        "new gang": None if ready is None else ready - (released or start),
        "restore": None if ready is None or running is None else running - ready,
        "first step": None if running is None else first_step - running,
    }


def hang_deadline(step_times: Sequence[float]) -> float:
    """The lag deadline a job had: 3x its slowest step, at least LAG_FLOOR_S."""
    return lag_deadline(max(step_times, default=0.0))


# -- the controller, started again on the same state directory and port -----------------


class _Controller(RestartableController):
    """A chaos-enabled controller on the simulation that can be started again on the same
    state directory and port; every process it started is gone at `close`."""

    def __init__(
        self,
        directory: Path,
        sim: str = SIM,
        ray_address: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            directory,
            sim=None if ray_address else sim,
            ray_address=ray_address,
            extra_args=("--allow-chaos",),
            env=env,
        )

    def events(self) -> list[tuple[float, str]]:
        return log_events(self.log_path(self.starts).read_text(errors="replace"))


# -- one fault, one plain restart --------------------------------------------------------


def _submit(client: Any, directory: Path, steps: int) -> tuple[Any, float]:
    submitted = time.time()
    job = client.submit_job(
        "lm",
        slices=SLICES,
        slice_type=SLICE_TYPE,
        steps=steps,
        overrides=CONFIG,
        checkpoint_every=EVERY,
        checkpoint_dir=str(directory),
        # Room for failures of a healthy gang under a 3 s step deadline (see above).
        max_failures=6,
    )
    return job, submitted


def _ended(client: Any, job_id: str, timeout_s: float = 600.0) -> tuple[Any, list[Any]]:
    """The job's info and step records once it has ended.

    Raises:
        RuntimeError: it did not succeed.
        TimeoutError: it did not end in time.
    """
    deadline = time.monotonic() + timeout_s
    while (info := client.job(job_id)).state not in ENDED:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} did not end within {timeout_s:g} s")
        time.sleep(0.1)
    if info.state != pb.JOB_STATE_SUCCEEDED:
        raise RuntimeError(f"job {job_id} did not succeed: {info.error}")
    return info, sorted(client.job_metrics(job_id).steps, key=lambda r: r.step)


def _slowest_before(records: Sequence[Any], resumed_from: int) -> list[float]:
    """Step times of the steps before `resumed_from` but the first (it compiles)."""
    return [r.step_time_s for r in records if 0 < r.step < resumed_from]


def injected_recovery(recoveries: Sequence[Any]) -> tuple[int, float]:
    """Which of a job's recoveries followed the injected fault (at step AT, after the
    checkpoint of step EVERY), and when the job first trained again after it: the
    `resumed_at` of that recovery, or of a later one where the watchdog failed the
    new gang again before its first step (`resumed_at` is only set on the newest).
    Others are failures nobody injected (see `spurious` in the results)."""
    index = next(i for i, r in enumerate(recoveries) if r.failed_at_step >= EVERY)
    resumed = next(r.resumed_at for r in recoveries[index:] if r.resumed_at)
    return index, resumed


def _recovered_run(
    ctl: _Controller, client: Any, kind: str, process: int, root: Path, label: str = ""
) -> dict:
    """A job meets `kind` on host `process` once step AT is done and recovers by itself;
    its figures go under `label` (default: the kind)."""
    directory = root / f"{kind}-{time.monotonic_ns()}"
    job, _ = _submit(client, directory, STEPS)
    client.inject_fault(job.job_id, kind, at_step=AT, process=process)
    info, records = _ended(client, job.job_id)
    index, resumed_at = injected_recovery(info.recoveries)
    r = info.recoveries[index]
    first = next(x for x in records if x.step == r.resumed_from_step)
    split = {"detect": r.detected_at - r.fault_at, "controller restart": 0.0}
    split |= phases(ctl.events(), job.job_id, r.detected_at, resumed_at)
    return {
        "kind": kind,
        "label": label or kind,
        "process": process,
        "job": job.job_id,
        "cause": r.cause,
        "detect_s": r.detected_at - r.fault_at,
        "recovery_s": resumed_at - r.fault_at,
        "failed_at_step": r.failed_at_step,
        "resumed_from_step": r.resumed_from_step,
        "steps_lost": r.steps_lost,
        "phases_s": split,
        "first_step_time_s": first.step_time_s,
        "spurious": [x.cause for i, x in enumerate(info.recoveries) if i != index],
        # The lag deadline the job had (what detects a hang).
        "step_deadline_s": hang_deadline(_slowest_before(records, r.resumed_from_step)),
        "checkpoint_dir": str(directory),
        "committed_step": info.committed_step,
    }


def _controller_run(ctl: _Controller, client: Any, root: Path) -> tuple[dict, Any]:
    """The controller kills itself once the job is past step AT and is started again at
    once on the same state directory and port. Returns the figures and a client of the
    new controller."""
    directory = root / f"kill-controller-{time.monotonic_ns()}"
    job, _ = _submit(client, directory, STEPS)
    deadline = time.monotonic() + 600
    while client.job(job.job_id).step < AT:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job.job_id} did not reach step {AT}")
        time.sleep(0.02)
    asked = time.time()
    client.inject_fault(job.job_id, "kill-controller")
    ctl.proc.proc.wait(timeout=60)
    gone = time.time()
    client.close()
    ctl.start()
    listening = time.time()
    import slicewise

    client = slicewise.connect(ctl.proc.address, name="bench-recovery")
    info, records = _ended(client, job.job_id)
    first = min((x for x in records if x.wall_time > gone), key=lambda x: x.wall_time)
    events = ctl.events()
    recorded = next(
        (
            int(m.group(1))
            for _, msg in events
            if (m := re.search(rf"job {job.job_id} resumes after .* \(step (\d+) recorded", msg))
        ),
        None,
    )
    # The new controller takes the job up just before it says it listens.
    taken_up = first_event(events, gone, rf"^job {job.job_id} resumes after") or listening
    split = {"detect": gone - asked, "controller restart": taken_up - gone}
    simulation = first_event(events, gone, r"^starting simulated cluster")
    split |= phases(events, job.job_id, taken_up, first.wall_time)
    resumed = info.resumed_from_step
    return {
        "kind": "kill-controller",
        "label": "kill-controller",
        "process": None,
        "job": job.job_id,
        "cause": "the controller was SIGKILLed and started again",
        "detect_s": gone - asked,
        "recovery_s": first.wall_time - asked,
        "failed_at_step": recorded,
        "resumed_from_step": resumed,
        "steps_lost": None if recorded is None else recorded - resumed,
        "phases_s": split,
        "first_step_time_s": first.step_time_s,
        "restarts": info.restarts,
        "spurious": [r.cause for r in info.recoveries],
        "listening_after_s": listening - gone,
        # The new process up to starting the simulation, and the simulation's start (on a
        # cluster the controller joined, there is none to start).
        "restart_split_s": (
            {"process": taken_up - gone}
            if simulation is None
            else {"process": simulation - gone, "simulation": taken_up - simulation}
        ),
        "checkpoint_dir": str(directory),
        "committed_step": info.committed_step,
    }, client


def _plain_restart(ctl: _Controller, client: Any, directory: str, committed: int) -> dict:
    """The baseline: the same job submitted again on its checkpoint directory (2 steps
    more than it holds); from the submission until its first step finished. A restart
    that the watchdog failed (a stall nobody injected, see the module docstring) is
    noted and made again."""
    spurious = []
    for _ in range(3):
        job, submitted = _submit(client, Path(directory), committed + 2)
        info, records = _ended(client, job.job_id)
        first = records[0]
        if not info.failures:
            break
        spurious += [r.cause for r in info.recoveries]
        committed = info.committed_step
    else:
        raise RuntimeError(f"plain restarts kept failing: {spurious}")
    if first.step != committed:
        raise RuntimeError(
            f"plain restart {job.job_id} began at step {first.step}, not {committed}"
        )
    split = {"detect": 0.0, "controller restart": 0.0}
    split |= phases(ctl.events(), job.job_id, submitted, first.wall_time)
    return {
        "job": job.job_id,
        "restart_s": first.wall_time - submitted,
        "restored_step": first.step,
        "phases_s": split,
        "first_step_time_s": first.step_time_s,
        "spurious": spurious,
    }


# -- the whole run -------------------------------------------------------------------------


def summarize_kind(runs: Sequence[dict]) -> dict[str, Any]:
    """Medians over the rounds of one kind's runs (each with its plain restart)."""
    ratios = [r["recovery_s"] / r["plain"]["restart_s"] for r in runs]

    def median_phases(split: list[dict[str, float | None]]) -> dict[str, float | None]:
        known = {p: [v for s in split if (v := s.get(p)) is not None] for p in PHASES}
        return {p: statistics.median(v) if v else None for p, v in known.items()}

    recovery = statistics.median(r["recovery_s"] for r in runs)
    return {
        "n": len(runs),
        "detect_s": statistics.median(r["detect_s"] for r in runs),
        "recovery_s": recovery,
        "recovery_s_all": [r["recovery_s"] for r in runs],
        "steps_lost": [r["steps_lost"] for r in runs],
        "plain_restart_s": statistics.median(r["plain"]["restart_s"] for r in runs),
        "plain_restart_s_all": [r["plain"]["restart_s"] for r in runs],
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "target_met": recovery <= TARGET_S,
        "target_met_every_round": all(r["recovery_s"] <= TARGET_S for r in runs),
        "phases_s": median_phases([r["phases_s"] for r in runs]),
        "plain_phases_s": median_phases([r["plain"]["phases_s"] for r in runs]),
        "first_step_time_s": statistics.median(r["first_step_time_s"] for r in runs),
        "plain_first_step_time_s": statistics.median(r["plain"]["first_step_time_s"] for r in runs),
        "step_deadline_s": max((r.get("step_deadline_s", 0.0) for r in runs), default=0.0),
        "spurious": sum(len(r["spurious"]) + len(r["plain"]["spurious"]) for r in runs),
        "restart_split_s": {
            part: statistics.median(known)
            for part in ("process", "simulation")
            if (known := [v for r in runs if (v := r.get("restart_split_s", {}).get(part))])
        },
    }


def run(quick: bool = False) -> dict[str, Any]:
    import slicewise

    rounds = 1 if quick else ROUNDS
    root = Path(tempfile.mkdtemp(prefix="slicewise-bench-recovery-"))
    print(f"   controller logs and checkpoints under {root}", flush=True)
    runs: list[dict] = []

    def measured(r: dict, ctl: _Controller, client: Any, n: int) -> None:
        r["plain"] = _plain_restart(ctl, client, r["checkpoint_dir"], r["committed_step"])
        runs.append(r | {"round": n})
        print(f"   round {n + 1}: {_line(r)}", flush=True)

    # The controller's default step deadline for the faults a watchdog does not have to
    # find.
    ctl = _Controller(root / "controller")
    client = None
    try:
        ctl.start()
        client = slicewise.connect(ctl.proc.address, name="bench-recovery")
        for n in range(rounds):
            for kind in ("kill-worker", "remove-host")[:: 1 if n % 2 == 0 else -1]:
                measured(_recovered_run(ctl, client, kind, n % SLICES, root), ctl, client, n)
            if n + 1 < rounds:  # remove-host used the spare up: a new simulation brings it
                client.close()
                client = None
                ctl.proc.stop()
                ctl.start()
                client = slicewise.connect(ctl.proc.address, name="bench-recovery")
    finally:
        if client is not None:
            client.close()
        ctl.close()
    # kill-controller on a controller joined to a cluster it does not own, as on TPU VMs,
    # where Ray outlives the controller (with --sim the simulation would go with it).
    cluster = SimulationProcess(SIM)
    ctl = _Controller(
        root / "restart-controller", ray_address=cluster.address, env=cluster.ray_env()
    )
    ctl.extra_args += ("--compilation-cache", str(root / "compilation-cache"))
    client = None
    try:
        ctl.start()
        client = slicewise.connect(ctl.proc.address, name="bench-recovery")
        for n in range(rounds):
            r, client = _controller_run(ctl, client, root)
            measured(r, ctl, client, n)
    finally:
        if client is not None:
            client.close()
        ctl.close()
        cluster.stop()
    ctl = _Controller(root / "hang-controller")
    client = None
    try:
        ctl.start()
        client = slicewise.connect(ctl.proc.address, name="bench-recovery")
        for n in range(rounds):
            r = _recovered_run(ctl, client, "hang-collective", n % SLICES, root)
            measured(r, ctl, client, n)
    finally:
        if client is not None:
            client.close()
        ctl.close()
    # Warm hosts, no spare: the new gang is the old one's hosts.
    ctl = _Controller(root / "warm-controller", sim=WARM_SIM)
    client = None
    try:
        ctl.start()
        client = slicewise.connect(ctl.proc.address, name="bench-recovery")
        for n in range(rounds):
            for kind in WARM_KINDS:
                r = _recovered_run(ctl, client, kind, n % SLICES, root, kind + NO_SPARE)
                measured(r, ctl, client, n)
    finally:
        if client is not None:
            client.close()
        ctl.close()
    return {
        "config": {
            "sim": SIM,
            "job": f"lm on {SLICES} x {SLICE_TYPE}, data parallel over the DCN",
            "lm_config": CONFIG,
            "steps": STEPS,
            "checkpoint_every": EVERY,
            "fault_at_step": AT,
            "warm_sim": WARM_SIM,
            "step_timeout_s": "default (20); a hang is detected by the lag deadline",
            "target_s": TARGET_S,
            "rounds": rounds,
            "cores": os.cpu_count(),
            "quick": quick,
        },
        "kinds": {k: summarize_kind([r for r in runs if r["label"] == k]) for k in LABELS},
        "runs": runs,
    }


def _line(r: dict) -> str:
    return (
        f"{r['kind']}: detect {r['detect_s']:.2f} s, fault -> first step "
        f"{r['recovery_s']:.2f} s, steps lost {r['steps_lost']}; plain restart "
        f"{r['plain']['restart_s']:.2f} s"
    )


def _fmt(v: float | None) -> str:
    return "?" if v is None else f"{v:.2f}"


def report(result: dict[str, Any]) -> str:
    kinds = result["kinds"]
    lines = [
        f"{'fault':<28}{'detect':>8}{'fault->1st step':>17}{'steps lost':>12}"
        f"{'plain restart':>15}{'ratio':>7}  target <= {TARGET_S:g} s"
    ]
    for kind, k in kinds.items():
        lost = ",".join(str(v) for v in k["steps_lost"])
        lines.append(
            f"{kind:<28}{k['detect_s']:>7.2f}s{k['recovery_s']:>16.2f}s{lost:>12}"
            f"{k['plain_restart_s']:>14.2f}s{k['ratio']:>7.2f}  "
            + ("met" if k["target_met"] else "MISSED")
            + ("" if k["target_met_every_round"] == k["target_met"] else " (not every round)")
        )
    lines.append("where the time goes (medians, s): " + " / ".join(PHASES))
    for kind, k in kinds.items():
        ours = " / ".join(_fmt(k["phases_s"][p]) for p in PHASES)
        plain = " / ".join(_fmt(k["plain_phases_s"][p]) for p in PHASES[3:])
        lines.append(
            f"  {kind:<27} {ours}  (first step's own time {k['first_step_time_s']:.2f}); "
            f"plain restart: {plain} (first step's own {k['plain_first_step_time_s']:.2f})"
        )
    split = kinds["kill-controller"]["restart_split_s"]
    if split:
        lines.append(
            "kill-controller's restart: "
            + ", ".join(f"{part} {v:.2f} s" for part, v in split.items())
            + " (the new controller process's start, to taking the job up)"
        )
    spurious = {k: v["spurious"] for k, v in kinds.items() if v["spurious"]}
    if spurious:
        lines.append(
            "gangs failed by the watchdog with no fault injected (runs kept, restarts made "
            f"again): {spurious}"
        )
    hang = kinds["hang-collective"]
    lines.append(
        f"hang: detected after {hang['detect_s']:.2f} s (median); the job's lag deadline "
        f"was {hang['step_deadline_s']:.2f} s (3x its slowest step, at least "
        f"{LAG_FLOOR_S:g} s), the lower bound of its detection"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    kinds = result["kinds"]
    palette = ["tab:red", "tab:purple", "tab:gray", "tab:orange", "tab:green", "tab:blue"]
    colors = dict(zip(PHASES, palette, strict=True))
    fig, ax = plt.subplots(figsize=(14, 5.5))
    x = np.arange(len(kinds))
    for offset, key, pale in ((-0.2, "phases_s", False), (0.2, "plain_phases_s", True)):
        bottom = np.zeros(len(kinds))
        for phase in PHASES:
            values = np.array([k[key][phase] or 0.0 for k in kinds.values()])
            ax.bar(
                x + offset,
                values,
                0.38,
                bottom=bottom,
                color=colors[phase],
                alpha=0.4 if pale else 1.0,
                label=phase if not pale and values.any() else None,
            )
            bottom += values
    for i, k in enumerate(kinds.values()):
        ax.scatter([i - 0.2], [k["recovery_s"]], marker="_", s=300, color="black", zorder=3)
        ax.scatter([i + 0.2], [k["plain_restart_s"]], marker="_", s=300, color="black", zorder=3)
        lost = ",".join(str(v) for v in k["steps_lost"])
        ax.text(
            i - 0.2,
            max(k["recovery_s"], k["plain_restart_s"], TARGET_S) + 0.4,
            f"{k['recovery_s']:.1f} s, {k['ratio']:.2f}x\nsteps lost {lost}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.axhline(TARGET_S, color="black", linestyle=":", label=f"target {TARGET_S:g} s")
    ax.bar(0, 0, color="lightgray", label="pale, right: plain restart from the checkpoint")
    top = max(max(k["recovery_s"], k["plain_restart_s"]) for k in kinds.values())
    ax.set_ylim(top=1.5 * max(top, TARGET_S))
    ax.set_xticks(x, [k.replace(NO_SPARE, "\nno spare") for k in kinds])
    ax.set_ylabel("s from the fault (plain: the submission)\nto the first step")
    ax.set_title(
        f"Recovery (left) vs plain restart (right), lm job on 2 x {SLICE_TYPE}, simulated; "
        f"medians of {result['config']['rounds']} round(s)\nbars: median of each phase; "
        "black: median total; label: total, ratio to the plain restart, steps lost",
        fontsize=10,
    )
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    result = run(parser.parse_args().quick)
    print(report(result))
    print(write_result("recovery", result, plot))


if __name__ == "__main__":
    main()
