"""The cluster's TPU slices, read from Ray's node table (pure: takes `ray.nodes()` rows).

A host belongs to a slice by its `ray.io/tpu-slice-name` label; single-host slices on
real TPU VMs may lack it, and are then named after their Ray node. A slice is intact
when every host of its type is alive; only intact slices can be allocated.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from controller.simcluster import (
    POD_TYPE_LABEL,
    SIMULATED_LABEL,
    SLICE_NAME_LABEL,
    WORKER_ID_LABEL,
)
from slicewise.common.errors import CapacityError, InvalidRequestError
from slicewise.common.topology import SLICE_TYPES, SliceType


@dataclass(frozen=True)
class Host:
    """One TPU VM (or simulated host): a Ray node."""

    node_id: str
    address: str
    worker_id: int
    chips: int
    alive: bool
    port: int = 0  # its raylet's (Ray's NodeManagerPort): answers while the host is up


@dataclass(frozen=True)
class Slice:
    """One TPU slice and the hosts Ray currently reports for it."""

    name: str
    type: SliceType
    hosts: tuple[Host, ...]
    simulated: bool

    @property
    def intact(self) -> bool:
        """Every host of the slice is alive and has its chips."""
        alive = {h.worker_id for h in self.hosts if h.alive and h.chips == self.type.chips_per_host}
        return alive == set(range(self.type.hosts))

    def host(self, worker_id: int) -> Host:
        for h in self.hosts:
            if h.worker_id == worker_id and h.alive:
                return h
        raise LookupError(f"slice {self.name} has no live host {worker_id}")


def slices_from_nodes(
    nodes: Iterable[Mapping[str, Any]], lost: Set[str] = frozenset()
) -> dict[str, Slice]:
    """Groups Ray nodes that carry TPU labels into slices, by slice name. Nodes in `lost`
    count as dead though Ray may not have noticed yet (the controller found their
    raylet gone: Ray's own health checks take several seconds more)."""
    grouped: dict[str, list[tuple[Host, SliceType, bool]]] = {}
    for node in nodes:
        labels = node.get("Labels") or {}
        pod_type = labels.get(POD_TYPE_LABEL)
        if pod_type not in SLICE_TYPES:
            continue  # not a v5e host (the head node, a CPU node, another TPU generation)
        stype = SLICE_TYPES[pod_type]
        name = labels.get(SLICE_NAME_LABEL) or node["NodeID"]
        host = Host(
            node_id=node["NodeID"],
            address=node.get("NodeManagerAddress", ""),
            worker_id=int(labels.get(WORKER_ID_LABEL, 0)),
            chips=int((node.get("Resources") or {}).get("TPU", 0)),
            alive=bool(node.get("Alive")) and node["NodeID"] not in lost,
            port=int(node.get("NodeManagerPort") or 0),
        )
        grouped.setdefault(name, []).append((host, stype, labels.get(SIMULATED_LABEL) == "true"))
    slices = {}
    for name, members in grouped.items():
        # A host that died and came back appears twice; the live entry wins.
        by_worker: dict[int, Host] = {}
        for host, _, _ in members:
            if host.alive or host.worker_id not in by_worker:
                by_worker[host.worker_id] = host
        slices[name] = Slice(
            name=name,
            type=members[0][1],
            hosts=tuple(sorted(by_worker.values(), key=lambda h: h.worker_id)),
            simulated=all(sim for _, _, sim in members),
        )
    return slices


def check_can_ever_fit(
    slices: Mapping[str, Slice],
    num_slices: int,
    stype: SliceType | Sequence[SliceType],
    *,
    same_type: bool = True,
) -> None:
    """Raises CapacityError when no amount of waiting could admit the request.

    Broken and held slices count, since hosts come back and gangs end. With `same_type`
    all `num_slices` must be of one of the acceptable types; without it they may mix.
    """
    if num_slices < 1:
        raise InvalidRequestError(f"a gang needs at least 1 slice, asked for {num_slices}")
    types = (stype,) if isinstance(stype, SliceType) else tuple(stype)
    if not types:
        raise InvalidRequestError("a gang needs at least one acceptable slice type")
    counts = _count_types(slices)
    of_type = [counts.get(t.name, 0) for t in types]
    most = max(of_type) if same_type else sum(of_type)
    if num_slices <= most:
        return
    have = ", ".join(f"{n} x {t}" for t, n in sorted(counts.items())) or "no TPU slices"
    if len(types) == 1:
        name = types[0].name
        raise CapacityError(
            f"asked for {num_slices} x {name} but the whole cluster has "
            f"{most} {name} slice(s) ({have}); ask for at most {most}, "
            "or for a slice type the cluster has"
        )
    names = ", ".join(t.name for t in types)
    asked = (
        f"{num_slices} slices of one type among {names}"
        if same_type
        else f"{num_slices} slices of {names} (types may mix)"
    )
    raise CapacityError(
        f"asked for {asked} but the whole cluster has "
        + ", ".join(f"{n} {t.name}" for t, n in zip(types, of_type, strict=True))
        + f" slice(s) ({have}); ask for at most {most}, or for slice types the cluster has"
    )


def _count_types(slices: Mapping[str, Slice]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in slices.values():
        counts[s.type.name] = counts.get(s.type.name, 0) + 1
    return counts
