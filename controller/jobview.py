"""What `slicewise train` and `slicewise watch` show: a live progress bar on a terminal,
one line per step otherwise (logs, pipes, tests), and the jobs table.

Step times and tokens/s are the workers' measurements of each step (see controller/jobs.py),
shown as they come: nothing here derives a rate from when reports arrive.

A step of a Mixture-of-Experts model also carries each MoE layer's routing, shown as one
line per layer: a bar with a block per expert, the busiest expert's load over the mean,
the share of choices dropped for capacity and the share served on the token's own slice.
The live view shows the latest step's; plain output, to keep logs short, only every
`EXPERT_EVERY` steps and on the job's last step.

Traffic between slices (DCN) is shown the same way, as one line under those: what the
workers measured per step (averaged over a window of steps; not every step carries a
measurement) next to what the controller predicted from the compiled program's collectives.
Plain output shows it every `EXPERT_EVERY` steps when that step carries a measurement, and
on the last step."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

from rich.console import Console, RenderableType
from rich.progress import Progress
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from protos import controller_pb2 as pb

TERMINAL = {pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED}

# Plain output shows the MoE layers' routing and the DCN traffic after every this many
# steps (and the last).
EXPERT_EVERY = 10

_BYTE_UNITS = ("kB", "MB", "GB")

_BLOCKS = "▁▂▃▄▅▆▇█"


def state_name(state: int) -> str:
    return pb.JobState.Name(state).removeprefix("JOB_STATE_").lower()


def step_time(seconds: float) -> str:
    """A step time for people: "0.42 ms", "4.2 ms", "312 ms", "2.50 s"."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    ms = 1e3 * seconds
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.2g} ms"


def step_line(job_id: str, steps: int, s: pb.StepMetrics) -> str:
    return (
        f"{job_id} step {s.step + 1}/{steps} loss {s.loss:.4f} "
        f"{s.tokens_per_s:,.0f} tok/s {step_time(s.step_time_s)}/step"
    )


def expert_bar(counts: Sequence[int]) -> str:
    """One block per expert, its height the expert's count in eighths of the busiest
    expert's, rounded up: "█" is the busiest, "▁" up to an eighth of it (or none at all).
    All zeros (or no experts) give all "▁"."""
    top = max(counts, default=0)
    if top <= 0:
        return _BLOCKS[0] * len(counts)
    return "".join(_BLOCKS[max(0, -(-8 * n // top) - 1)] for n in counts)


def max_over_mean(counts: Sequence[int]) -> float | None:
    """The busiest expert's count over the mean count (1.0: perfectly balanced); None when
    no expert served anything."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total > 0 else None


def expert_line(load: pb.ExpertLoad) -> str:
    """One MoE layer's routing in a step: "moe0 load ▂▃█▁ max/mean 1.9 drop 2.1% local 63%"."""
    ratio = max_over_mean(load.tokens_per_expert)
    return (
        f"moe{load.layer} load {expert_bar(load.tokens_per_expert)} "
        f"max/mean {'-' if ratio is None else f'{ratio:.1f}'} "
        f"drop {load.dropped_fraction:.1%} local {load.local_fraction:.0%}"
    )


def expert_lines(job_id: str, s: pb.StepMetrics) -> list[str]:
    """The step's MoE routing, a line per layer, indented under its step line."""
    return [f"{job_id}   {expert_line(load)}" for load in s.experts]


def shows_details(steps: int, s: pb.StepMetrics) -> bool:
    """Whether plain output shows more than step `s`'s line (routing, DCN traffic) after
    it: every `EXPERT_EVERY` steps and the job's last step (of `steps`)."""
    done = s.step + 1
    return done % EXPERT_EVERY == 0 or done == steps


def shows_experts(steps: int, s: pb.StepMetrics) -> bool:
    """Whether plain output shows step `s`'s routing: on the steps it shows details on,
    when it has any."""
    return bool(s.experts) and shows_details(steps, s)


def human_bytes(n: float) -> str:
    """Bytes for people in decimal units to 3 significant digits, trailing zeros kept:
    "0 B", "999 B", "1.23 kB", "1.50 MB", "12.0 GB". Below a kB whole bytes; GB is the
    largest unit ("1500 GB")."""
    if round(n) < 1000:
        return f"{n:.0f} B"
    for unit in _BYTE_UNITS:
        n /= 1000
        for decimals in (2, 1, 0):
            text = f"{n:.{decimals}f}"
            # Rounding can carry into the next digit ("9.995" -> "10.00"): one decimal less.
            if float(text) < 10 ** (3 - decimals):
                return f"{text} {unit}"
    return f"{n:.0f} {_BYTE_UNITS[-1]}"


def _dcn_predicted(job: pb.JobInfo) -> str:
    return (
        f"predicted {human_bytes(job.dcn_bytes_predicted)}, "
        f"{job.dcn_messages_predicted:,} messages/step"
    )


def dcn_line(job: pb.JobInfo, s: pb.StepMetrics) -> str | None:
    """Step `s`'s measured traffic between slices and the job's predicted traffic, e.g.
    "dcn measured 1.23 MB/step, 410 segments/step (over 10 steps); predicted 1.10 MB, 96
    messages/step", leaving out the half it lacks; None when it has neither."""
    parts = []
    if s.dcn_window > 0:
        plural = "s" if s.dcn_window > 1 else ""
        parts.append(
            f"measured {human_bytes(s.dcn_bytes)}/step, {s.dcn_segments:,.0f} segments/step "
            f"(over {s.dcn_window} step{plural})"
        )
    if job.dcn_predicted:
        parts.append(_dcn_predicted(job))
    return "dcn " + "; ".join(parts) if parts else None


def detail_lines(job: pb.JobInfo, s: pb.StepMetrics) -> list[str]:
    """What plain output shows under step `s`'s line: on the steps `shows_details` picks,
    its routing and its DCN line; the latter only when the step carries a measurement or is
    the last, so that a prediction alone is not repeated every `EXPERT_EVERY` steps."""
    if not shows_details(job.steps, s):
        return []
    lines = expert_lines(job.job_id, s)
    dcn = dcn_line(job, s)
    if dcn is not None and (s.dcn_window > 0 or s.step + 1 == job.steps):
        lines.append(f"{job.job_id}   {dcn}")
    return lines


def follow(
    events: Iterable[pb.JobEvent], *, plain: bool | None = None, out: TextIO = sys.stdout
) -> pb.JobInfo:
    """Shows a job's event stream until it ends; returns the final job info."""
    plain = (not out.isatty()) if plain is None else plain
    return _follow_plain(events, out) if plain else _follow_live(events)


def _follow_plain(events: Iterable[pb.JobEvent], out: TextIO) -> pb.JobInfo:
    job = None
    last_state = None
    for event in events:
        job = event.job
        if event.message and (event.message != "attached" or job.state != last_state):
            state = state_name(job.state)
            # A move to a state with nothing more to say names the state once ("j1 succeeded").
            said = "" if event.message == state else f": {event.message}"
            print(f"{job.job_id} {state}{said}", file=out, flush=True)
        last_state = job.state
        for s in event.steps:
            print(step_line(job.job_id, job.steps, s), file=out, flush=True)
            for line in detail_lines(job, s):
                print(line, file=out, flush=True)
    if job is None:
        raise RuntimeError("the controller ended the stream before sending anything")
    return job


# The progress bar's width: at most, and the least worth drawing.
BAR_MAX, BAR_MIN = 40, 10


def progress_parts(
    head: str, count: str, loss: str, extras: Sequence[str], remaining: str, width: int
) -> tuple[str, int, str]:
    """The live line of a job in `width` columns: (left text, bar width, right text).

    The job and its state on the left; the step count, the loss and the time remaining
    always on the right; `extras` (step time, tokens/s) after the loss while they fit,
    the last dropped first; a bar between the two where at least `BAR_MIN` columns are
    left. What goes first when the terminal is narrow is the bar, then the extras.
    """
    kept = list(extras)
    while True:
        right = "  ".join(p for p in (count, loss, *kept, remaining) if p)
        room = width - len(head) - len(right) - 2  # a space either side of the bar
        if room >= BAR_MIN:
            return head, min(BAR_MAX, room), right
        if room >= -1 or not kept:  # fits without the bar (or nothing more can go)
            return head, 0, right
        kept.pop()


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class _JobProgress(Progress):
    """The live view: one line per job, laid out for the terminal's width at every
    refresh (`progress_parts`), then lines of text below it: the latest step's routing
    and the latest DCN measurement."""

    below: tuple[str, ...] = ()

    def get_renderables(self) -> Iterable[RenderableType]:
        for task in self.tasks:  # none yet while Progress builds its Live (no console)
            width = self.console.width
            head, bar, right = progress_parts(
                task.description,
                f"{int(task.completed)}/{int(task.total or 0)}",
                task.fields.get("loss", ""),
                task.fields.get("extras", ()),
                _clock(task.time_remaining),
                width,
            )
            line = Table.grid(padding=(0, 1))
            cells: list[RenderableType] = [Text(head, style="bold", no_wrap=True)]
            if bar:
                line.add_column(width=len(head), no_wrap=True)
                line.add_column(width=bar)
                cells.append(ProgressBar(total=task.total, completed=task.completed, width=bar))
            else:
                line.add_column(no_wrap=True)
            line.add_column(no_wrap=True)
            cells.append(Text(right, no_wrap=True))
            line.add_row(*cells)
            yield line
        for text in self.below:
            yield Text(text)


def _follow_live(events: Iterable[pb.JobEvent]) -> pb.JobInfo:
    console = Console()
    job = None
    with _JobProgress(console=console, transient=False) as progress:
        task = None
        routing: tuple[str, ...] = ()
        measured: pb.StepMetrics | None = None  # the latest step with a DCN measurement
        for event in events:
            job = event.job
            if task is None:
                task = progress.add_task(job.job_id, total=job.steps, loss="", extras=())
            # A move to a state with nothing more to say shows in the line itself.
            if event.message not in ("", "attached", state_name(job.state)):
                console.print(f"{job.job_id} {state_name(job.state)}: {event.message}")
            loss = ""
            extras: tuple[str, ...] = ()
            if job.HasField("last"):
                s = job.last
                loss = f"loss {s.loss:.4f}"
                extras = (f"{step_time(s.step_time_s)}/step", f"{s.tokens_per_s:,.0f} tok/s")
                routing = tuple(f"  {expert_line(load)}" for load in s.experts)
            for s in (*event.steps, *([job.last] if job.HasField("last") else [])):
                if s.dcn_window > 0:
                    measured = s
            dcn = dcn_line(job, measured or pb.StepMetrics())
            progress.below = routing + (() if dcn is None else (f"  {dcn}",))
            progress.update(
                task,
                completed=job.step,
                description=f"{job.job_id} {state_name(job.state)}",
                loss=loss,
                extras=extras,
            )
    if job is None:
        raise RuntimeError("the controller ended the stream before sending anything")
    return job


def summary(job: pb.JobInfo, steps: list[pb.StepMetrics]) -> str:
    text = f"{job.job_id} {state_name(job.state)} after {job.step}/{job.steps} steps"
    if steps:
        tail = steps[-10:]
        # Tokens over time, not the mean of the steps' rates (which a short step inflates).
        seconds = sum(s.step_time_s for s in tail)
        tokens = sum(s.tokens_per_s * s.step_time_s for s in tail)
        text += (
            f"; loss {steps[0].loss:.4f} -> {steps[-1].loss:.4f}, "
            f"{tokens / seconds if seconds > 0 else 0:,.0f} tok/s over the last "
            f"{len(tail)} steps"
        )
    if job.flops_per_step:
        text += f"; {job.flops_per_step / 1e9:.2f} GFLOP/step"
    text += f"; {checkpoint(job)}"
    if job.preemptions:
        text += f"; preempted {job.preemptions} time{'s' if job.preemptions > 1 else ''}"
    if job.failures:
        text += f"; recovered from {job.failures} gang failure"
        text += "s" if job.failures > 1 else ""
    if job.restarts:
        text += f"; continued after {job.restarts} controller restart"
        text += "s" if job.restarts > 1 else ""
    if (job.preemptions or job.restarts or job.failures) and job.HasField("resumed_from_step"):
        text += f", resumed from step {job.resumed_from_step}"
    if job.error:
        text += f"; error: {job.error}"
    lines = expert_summary(steps)
    dcn = dcn_summary(job, steps)
    if dcn is not None:
        lines.append(dcn)
    return text + "".join(f"\n{line}" for line in lines)


def expert_summary(steps: list[pb.StepMetrics]) -> list[str]:
    """Per MoE layer: its routing in the last step that reported it, and its dropped share
    over all of `steps` that did (a mean of the steps' fractions); [] without MoE layers."""
    last: dict[int, tuple[int, pb.ExpertLoad]] = {}
    dropped: dict[int, list[float]] = {}
    for s in steps:
        for load in s.experts:
            last[load.layer] = (s.step, load)
            dropped.setdefault(load.layer, []).append(load.dropped_fraction)
    lines = []
    for layer in sorted(last):
        step, load = last[layer]
        fractions = dropped[layer]
        lines.append(
            f"  {expert_line(load)} at step {step + 1}; mean drop "
            f"{sum(fractions) / len(fractions):.1%} over {len(fractions)} steps"
        )
    return lines


def dcn_summary(job: pb.JobInfo, steps: list[pb.StepMetrics]) -> str | None:
    """The traffic between slices measured over all of `steps` that carry a measurement
    (their means weighted by their windows, which are taken not to overlap) and the job's
    prediction; None when no step carries one."""
    measured = [s for s in steps if s.dcn_window > 0]
    if not measured:
        return None
    window = sum(s.dcn_window for s in measured)
    per_step = sum(s.dcn_bytes * s.dcn_window for s in measured) / window
    segments = sum(s.dcn_segments * s.dcn_window for s in measured) / window
    text = (
        f"  dcn {human_bytes(per_step)}/step measured over {window} step"
        f"{'s' if window > 1 else ''} ({segments:,.0f} segments/step)"
    )
    if job.dcn_predicted:
        text += f"; {_dcn_predicted(job)}"
    return text


def checkpoint(job: pb.JobInfo) -> str:
    """The job's checkpoints in a few words: the last committed step, and where."""
    if job.HasField("committed_step"):
        text = f"last committed checkpoint: step {job.committed_step}"
    else:
        text = "no committed checkpoint"
    if job.checkpoint_every:
        kept = f"the newest {job.keep_checkpoints}" if job.keep_checkpoints else "all"
        if job.keep_steps:
            kept += f" and step{'s' if len(job.keep_steps) > 1 else ''} "
            kept += ", ".join(map(str, job.keep_steps))
        text += f" (every {job.checkpoint_every} steps, keeping {kept}, in {job.checkpoint_dir})"
    elif job.checkpoint_dir:
        text += f" (checkpoints off; directory {job.checkpoint_dir})"
    return text


def print_jobs(jobs: list[pb.JobInfo], console: Console | None = None) -> None:
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    table = Table(title="Jobs")
    for col in (
        "job",
        "program",
        "state",
        "step",
        "committed",
        "loss",
        "step time",
        "tok/s",
        "gang",
        "slices",
    ):
        table.add_column(col)
    for j in jobs:
        last = j.last if j.HasField("last") else None
        table.add_row(
            j.job_id,
            j.program,
            state_name(j.state),
            f"{j.step}/{j.steps}",
            str(j.committed_step) if j.HasField("committed_step") else "-",
            f"{last.loss:.4f}" if last else "-",
            step_time(last.step_time_s) if last else "-",
            f"{last.tokens_per_s:,.0f}" if last else "-",
            j.gang_id or "-",
            f"{j.num_slices} x {j.slice_type}",
        )
    console.print(table)
