"""`slicewise status`: the controller's view of the cluster as readable tables."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from protos import controller_pb2 as pb

_STATE = {
    pb.SLICE_STATE_FREE: "[green]free[/]",
    pb.SLICE_STATE_HELD: "[yellow]held[/]",
    pb.SLICE_STATE_BROKEN: "[red]broken[/]",
}


def print_status(health: pb.HealthResponse, info: pb.ClusterInfo,
                 console: Console | None = None) -> None:
    # Piped output gets a fixed width, so that names are not cut at 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    where = "simulated (CPU XLA devices)" if info.simulated else "TPU"
    console.print(f"slicewise {health.version} - {where}, up {health.uptime_s:.0f} s, "
                  f"{len(info.slices)} slice(s), {len(info.gangs)} gang(s)")
    slices = Table(title="Slices")
    for col in ("slice", "type", "topology", "chips", "hosts up", "state", "holder"):
        slices.add_column(col)
    for s in info.slices:
        up = sum(h.alive for h in s.hosts)
        slices.add_row(s.name, s.slice_type, s.topology, str(s.chips), f"{up}/{len(s.hosts)}",
                       _STATE.get(s.state, "?"), s.holder_gang or "-")
    console.print(slices)
    if info.gangs:
        gangs = Table(title="Gangs")
        for col in ("gang", "client", "type", "slices", "dispatched", "completed", "arrays"):
            gangs.add_column(col)
        for g in info.gangs:
            gangs.add_row(g.gang_id, g.client or "-", g.slice_type, ", ".join(g.slices),
                          str(g.dispatched), str(g.completed), str(g.live_arrays))
        console.print(gangs)
