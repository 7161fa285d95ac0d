"""Choosing preemption victims: the cheapest set of whole gangs whose slices make a
blocked request fit. Pure; used by the scheduler (and its naive twin in benchmarks/).

Cost is lexicographic (`victim_cost`): fewest chips taken from victims (every chip of
every victim gang), then the lowest highest-victim priority, then the set whose
earliest-admitted victim was admitted latest (least work thrown away).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

_INF = math.inf


class Candidate(NamedTuple):
    """A gang that may be evicted: how many useful slices it frees, what it costs."""

    gang_id: str
    cover: int
    chips: int
    priority: int
    seq: int


def victim_cost(victims: Iterable[Candidate]) -> tuple[float, float, float]:
    """(chips taken, highest victim priority, -earliest admission): smaller is cheaper."""
    victims = list(victims)
    if not victims:
        return (0, -_INF, -_INF)
    return (
        sum(v.chips for v in victims),
        max(v.priority for v in victims),
        -min(v.seq for v in victims),
    )


def cheapest_victims(candidates: Iterable[Candidate], need: int) -> tuple[Candidate, ...] | None:
    """The cheapest set of candidates (by `victim_cost`) covering `need` slices, or None."""
    if need <= 0:
        return ()
    # An optimal set is a minimal cover (every gang has chips), so it takes at most
    # ceil(need / cover) gangs of one (cover, chips, priority) class, and the latest
    # admitted of a class are never worse: keep only those.
    classes: dict[tuple[int, int, int], list[Candidate]] = {}
    for c in candidates:
        if c.cover > 0:
            classes.setdefault((c.cover, c.chips, c.priority), []).append(c)
    groups = []
    for key, members in sorted(classes.items(), key=lambda kv: (kv[0][2], kv[0])):
        members.sort(key=lambda c: -c.seq)
        groups.append((*key, members[: -(-need // key[0])]))
    # The cost is lexicographic, so settle one part at a time: the fewest chips; then the
    # lowest priority level whose gangs (and lower ones) still reach that; then admit gangs
    # newest first until it is reached, which makes the earliest victim as late as can be.
    fewest = _fewest_chips(groups, need)
    if fewest is None:
        return None
    level = next(
        i
        for i in range(1, len(groups) + 1)
        if (i == len(groups) or groups[i][2] != groups[i - 1][2])
        and _fewest_chips(groups[:i], need) == fewest
    )
    pool = sorted((c for g in groups[:level] for c in g[3]), key=lambda c: -c.seq)
    best: list[float] = [0] + [_INF] * need
    links: list[tuple | None] = [None] * (need + 1)
    top = 0  # the most slices the gangs so far cover: nothing above is reachable yet
    for item in pool:
        cover, chips = item.cover, item.chips
        for n in range(min(top, need - 1), -1, -1):
            v = best[n] + chips
            t = n + cover if n + cover < need else need
            if v < best[t]:
                best[t], links[t] = v, (item, links[n])
        top += cover
        if best[need] == fewest:
            break
    chosen, link = [], links[need]
    while link is not None:
        chosen.append(link[0])
        link = link[1]
    return tuple(sorted(chosen, key=lambda c: c.seq))


def _fewest_chips(groups: list[tuple[int, int, int, list[Candidate]]], need: int) -> float | None:
    """Bounded knapsack: the fewest chips covering `need`, taking up to len(members) a class."""
    best: list[float] = [0] + [_INF] * need
    top = 0
    for cover, chips, _, members in groups:
        left, bundle = len(members), 1
        while left:  # bundles of 1, 2, 4, ... gangs make every count reachable
            b = min(bundle, left)
            left, bundle = left - b, bundle * 2
            for c in range(min(top, need - 1), -1, -1):
                v = best[c] + b * chips
                t = c + b * cover if c + b * cover < need else need
                if v < best[t]:
                    best[t] = v
            top += b * cover
    return None if best[need] == _INF else best[need]
