"""Load-aware expert placement: which slice each MoE expert should live on, decided by the
controller between steps from the routing its steps reported.

An MoE job's experts are split over its expert axes in blocks: expert position p (its index
in the expert dimension) runs on slice `p // (E / S)`. Tokens on slice s that choose an
expert on another slice cross the DCN and come back. The steps report how many choices the
tokens of each slice made of each expert (`ExpertLoad.tokens_by_slice`); `plan` sums them
over a window and finds the assignment of experts to positions that keeps the most choices
on their own slice: a linear assignment (each expert to one position, each position one
expert) maximising the choices served locally, solved exactly with SciPy's
`linear_sum_assignment` (a Hungarian-method solver; SciPy comes with JAX).

A move renumbers the experts (`programs.moe.model.permute_experts`), which changes where
they run and not what the model computes, so the job's loss curve goes on as it would have.
A move costs a reshuffle of the moved experts' weights and optimizer moments, so `plan`
proposes one only when it raises the local share by at least `min_gain`, and among equally
good placements keeps experts where they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from controller.journal import ExpertLoad


@dataclass(frozen=True)
class Placement:
    """A re-placement of every MoE layer's experts.

    Attributes:
        order: int [L, E]: position p of layer l takes the expert now at `order[l, p]`.
        local_before: the share of the window's choices served on their own slice, as the
            experts are placed now.
        local_after: the same share had the experts been placed by `order`.
        moved: how many experts change position, over all layers.
    """

    order: np.ndarray
    local_before: float
    local_after: float
    moved: int

    def describe(self) -> str:
        return (
            f"moved {self.moved} experts between slices: local choices "
            f"{self.local_before:.0%} -> {self.local_after:.0%} of the last window's routing"
        )


def routing_by_slice(loads: Iterable[Iterable[ExpertLoad]]) -> np.ndarray | None:
    """The steps' choices by (layer, token's slice, expert) summed: int64 [L, S, E]; None
    when a step did not report them per slice or the steps disagree on the shape."""
    total: np.ndarray | None = None
    for step in loads:
        layers = list(step)
        if not layers or any(not e.tokens_by_slice for e in layers):
            return None
        counts = np.asarray([e.tokens_by_slice for e in layers], np.int64)
        if total is None:
            total = counts
        elif total.shape != counts.shape:
            return None
        else:
            total += counts
    return total


def plan(by_slice: np.ndarray, min_gain: float = 0.05) -> Placement | None:
    """The placement of experts over slices that serves the most choices of `by_slice`
    (int [L, S, E], see `routing_by_slice`) on their own slice; None if it would raise the
    local share by less than `min_gain` (or nothing was routed).

    Raises:
        ValueError: `by_slice` is not [L, S, E] with E a multiple of S.
    """
    counts = np.asarray(by_slice, np.int64)
    if counts.ndim != 3:
        raise ValueError(f"routing by slice must be [layers, slices, experts], got {counts.shape}")
    layers, slices, experts = counts.shape
    if slices < 1 or experts % slices:
        raise ValueError(f"{experts} experts do not split over {slices} slices")
    total = int(counts.sum())
    if total == 0:
        return None
    slice_of = np.arange(experts) // (experts // slices)  # position -> slice
    order = np.empty((layers, experts), np.int64)
    before = after = 0
    for layer in range(layers):
        # gain[e, p]: choices served locally if expert e sits at position p. Scaled so that
        # staying put breaks ties only: (E + 1) * count >= count + E > any sum of stays.
        gain = counts[layer][slice_of].T  # [E expert, E position]
        score = gain * (experts + 1) + np.eye(experts, dtype=np.int64)
        rows, cols = linear_sum_assignment(score, maximize=True)
        order[layer, cols] = rows
        before += int(np.trace(gain))
        after += int(gain[rows, cols].sum())
    moved = int(np.sum(order != np.arange(experts)))
    placement = Placement(order, before / total, after / total, moved)
    if moved == 0 or placement.local_after - placement.local_before < min_gain:
        return None
    return placement
