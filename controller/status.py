"""`slicewise status`: the controller's view of the cluster as readable tables: slices
and hosts, gangs (with the shares of a shared gang), the admission queue, and jobs."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from controller.jobview import print_jobs
from protos import controller_pb2 as pb

_STATE = {
    pb.SLICE_STATE_FREE: "[green]free[/]",
    pb.SLICE_STATE_HELD: "[yellow]held[/]",
    pb.SLICE_STATE_BROKEN: "[red]broken[/]",
}


def print_status(
    health: pb.HealthResponse,
    info: pb.ClusterInfo,
    jobs: list[pb.JobInfo],
    console: Console | None = None,
) -> None:
    # Piped output gets a fixed width, so that names are not cut at 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    where = "simulated (CPU XLA devices)" if info.simulated else "TPU"
    console.print(
        f"slicewise {health.version} - {where}, up {health.uptime_s:.0f} s, "
        f"{len(info.slices)} slice(s), {len(info.gangs)} gang(s), "
        f"{len(info.queue)} queued request(s)"
    )
    slices = Table(title="Slices")
    for col in ("slice", "type", "topology", "chips", "hosts up", "state", "holder"):
        slices.add_column(col)
    for s in info.slices:
        up = sum(h.alive for h in s.hosts)
        slices.add_row(
            s.name,
            s.slice_type,
            s.topology,
            str(s.chips),
            f"{up}/{len(s.hosts)}",
            _STATE.get(s.state, "?"),
            s.holder_gang or "-",
        )
    console.print(slices)
    if info.gangs:
        gangs = Table(title="Gangs")
        for col in (
            "gang",
            "client",
            "state",
            "priority",
            "type",
            "slices",
            "dispatched",
            "completed",
            "arrays",
            "shares",
        ):
            gangs.add_column(col)
        for g in info.gangs:
            shares = (
                ", ".join(
                    f"{s.client or s.attachment} w={s.weight:g} ran {s.programs_run}"
                    for s in g.shares
                )
                or "-"
            )
            name = f"{g.gang_id} ({g.shared_name})" if g.shared_name else g.gang_id
            gangs.add_row(
                name,
                g.client or "-",
                g.state,
                str(g.priority),
                g.slice_type,
                ", ".join(g.slices),
                str(g.dispatched),
                str(g.completed),
                str(g.live_arrays),
                shares,
            )
        console.print(gangs)
    if info.queue:
        queue = Table(title="Admission queue")
        for col in ("position", "request", "client", "wants", "priority", "waited", "why"):
            queue.add_column(col)
        for q in info.queue:
            queue.add_row(
                str(q.position),
                q.request_id,
                q.client or "-",
                f"{q.num_slices} x {'/'.join(q.slice_types)}",
                str(q.priority),
                f"{q.waited_s:.0f} s",
                q.reason,
            )
        console.print(queue)
    if jobs:
        print_jobs(jobs, console)
