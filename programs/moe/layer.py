"""The Mixture-of-Experts layer as a pure JAX function: top-k routing with per-expert
capacity, and GShard-style dispatch and combine through one-hot tensors.

`moe_layer(params, x, cfg) -> (y, stats)` with `params = {"router": [D, E], "w1": [E, D, H],
"w2": [E, H, D]}` and `x: [T, D]` (tokens flattened). The tokens are cut into G groups of
T_g = `group_size` tokens (one group of all T by default); each group routes on its own:

- `probs = softmax(x @ router)`; each token chooses its top-k experts, ties going to the
  lower expert index; the gates are those probabilities, renormalised over the k chosen
  (before any is dropped) when `renormalize`.
- Each expert has `expert_capacity(...)` slots per group, claimed in order of (choice rank,
  token index): every first choice of the group before any second choice. A choice that
  finds its expert full is dropped: it contributes 0 and the caller's residual carries the
  token. `capacity_factor=None` is dropless.
- Expert e computes `gelu_tanh(x @ w1[e]) @ w2[e]`; a token's output is the gate-weighted
  sum of its kept choices.

The expert dimension stays explicit throughout ([E, G, C, D] between dispatch and combine),
so that an `expert` mesh axis can later split it, with all-to-alls at the two places marked
below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from programs.base import ConfigError

Params = dict[str, jax.Array]

# Every contraction at full float32 precision: on TPU the default would round f32 operands
# to bf16, which moves router decisions and makes the one-hot dispatch inexact. A model
# that wants speed passes dtype="bfloat16" instead.
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclass(frozen=True)
class MoELayerConfig:
    """How one MoE layer routes tokens to experts; the sizes (D, E, H) come from the params.

    Attributes:
        k: experts per token, 1 (Switch) or 2 (GShard).
        capacity_factor: slots per expert per group are `ceil(T_g / E) * capacity_factor`
            (rounded up, see `expert_capacity`); None is dropless.
        renormalize: divide the k gates of a token by their sum.
        group_size: tokens per routing group (T_g); None routes all of `x` as one group.
            The token count must be a multiple of it.
        dtype: dtype of the dispatched activations and of the expert matmuls. The router
            always runs in float32.
    """

    k: int = 2
    capacity_factor: float | None = 1.25
    renormalize: bool = True
    group_size: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or self.k not in (1, 2):
            raise ConfigError(f"k={self.k!r} must be 1 or 2")
        cf = self.capacity_factor
        if cf is not None and (
            isinstance(cf, bool)
            or not isinstance(cf, int | float)
            or not math.isfinite(cf)
            or cf <= 0
        ):
            raise ConfigError(
                f"capacity_factor={cf!r} must be a finite number > 0, or None for dropless"
            )
        gs = self.group_size
        if gs is not None and (isinstance(gs, bool) or not isinstance(gs, int) or gs < 1):
            raise ConfigError(f"group_size={gs!r} must be a positive int, or None for one group")
        if not isinstance(self.renormalize, bool):
            raise ConfigError(f"renormalize={self.renormalize!r} must be a bool")
        try:
            floating = jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise ConfigError(f"dtype={self.dtype!r} must name a floating dtype, e.g. 'float32'")


def expert_capacity(cfg: MoELayerConfig, tokens_per_group: int, num_experts: int) -> int:
    """Slots per expert per group: `ceil(ceil(T_g / E) * capacity_factor)`, at most T_g.

    A fractional product rounds up (T_g=12, E=4, factor 1.25: 3 * 1.25 = 3.75 -> 4 slots).
    No expert can receive more than T_g choices (a token picks an expert at most once), so
    capping at T_g changes no decision and only saves memory; dropless
    (`capacity_factor=None`) is exactly that cap: T_g slots hold every choice.
    """
    if cfg.capacity_factor is None:
        return tokens_per_group
    base = -(-tokens_per_group // num_experts)
    # The 1e-9 keeps a product that float rounding pushed just past an integer
    # (10 * 1.1 = 11.000000000000002) from taking one more slot than the exact product.
    slots = math.ceil(base * cfg.capacity_factor - 1e-9)
    return max(1, min(tokens_per_group, slots))


class Routing(NamedTuple):
    """Where the choices of G groups of T_g tokens go: E experts with C slots each."""

    dispatch: jax.Array  # [G, T_g, E, C] bool: token t's choice of expert e sits in slot c
    combine: jax.Array  # [G, T_g, E, C] float32: that choice's gate where dispatch, else 0
    probs: jax.Array  # [G, T_g, E] float32 router probabilities
    experts: jax.Array  # [G, T_g, k] int32 chosen experts, best first
    gates: jax.Array  # [G, T_g, k] float32 their gates (renormalised if configured)
    kept: jax.Array  # [G, T_g, k] bool: the choice found a slot


def route(logits: jax.Array, cfg: MoELayerConfig, capacity: int) -> Routing:
    """Top-k choices, gates and capacity slots for router `logits` [G, T_g, E]."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    num_experts = probs.shape[-1]
    # Top-k by repeated argmax: argmax returns the first maximum, so ties go to the lower
    # expert index, and a masked expert (-inf) is never chosen again.
    masked = probs
    choices = []
    for _ in range(cfg.k):
        best = jnp.argmax(masked, axis=-1).astype(jnp.int32)
        choices.append(best)
        masked = jnp.where(jax.nn.one_hot(best, num_experts, dtype=bool), -jnp.inf, masked)
    experts = jnp.stack(choices, axis=-1)
    gates = jnp.take_along_axis(probs, experts, axis=-1)
    if cfg.renormalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)

    # Slots in order of (rank, token): within a rank a token's slot is the number of
    # earlier tokens of its group choosing the same expert at that rank, plus every claim
    # made at lower ranks. Claims past capacity still count; they only push later claims
    # further past it, which drops them as the order requires.
    groups = probs.shape[0]
    claimed = jnp.zeros((groups, num_experts), jnp.int32)
    dispatch = jnp.zeros((*probs.shape, capacity), bool)
    combine = jnp.zeros((*probs.shape, capacity), jnp.float32)
    kept = []
    for rank in range(cfg.k):
        chose = jax.nn.one_hot(experts[..., rank], num_experts, dtype=jnp.int32)  # [G, T_g, E]
        position = jnp.cumsum(chose, axis=1) - 1 + claimed[:, None, :]
        claimed = claimed + jnp.sum(chose, axis=1)
        slot = jnp.sum(position * chose, axis=-1)  # [G, T_g]
        keep = slot < capacity
        here = (
            chose.astype(bool)[..., None]
            & jax.nn.one_hot(slot, capacity, dtype=bool)[..., None, :]
            & keep[..., None, None]
        )
        dispatch = dispatch | here
        combine = combine + here * gates[..., rank, None, None]
        kept.append(keep)
    return Routing(dispatch, combine, probs, experts, gates, jnp.stack(kept, axis=-1))


def check_params(params: Params, x: jax.Array) -> tuple[int, int]:
    """(T, E) of a layer call.

    Raises:
        ConfigError: the params and `x` disagree on sizes.
    """
    router, w1, w2 = params["router"], params["w1"], params["w2"]
    tokens, d_model = x.shape
    num_experts = router.shape[1]
    if (
        router.shape != (d_model, num_experts)
        or w1.shape[:2] != (num_experts, d_model)
        or w2.shape != (num_experts, w1.shape[2], d_model)
    ):
        raise ConfigError(
            f"MoE params do not fit x [T, D] = {list(x.shape)}: need router [D, E], w1 [E, D, H] "
            f"and w2 [E, H, D], got {list(router.shape)}, {list(w1.shape)}, {list(w2.shape)}"
        )
    return tokens, num_experts


def moe_layer(
    params: Params, x: jax.Array, cfg: MoELayerConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MoE layer's output for tokens `x` [T, D], and its routing statistics.

    Returns:
        `y` [T, D] in x's dtype (no residual added), and `stats`, over all T tokens:
        `aux_loss` = E * sum_e f_e * P_e (f_e: fraction of tokens whose first choice is e,
        dropped or not; P_e: mean router probability of e), `z_loss` = mean over tokens of
        logsumexp(logits)^2, both unweighted (the model's loss weighs them);
        `dropped_fraction` = dropped choices / (k * T); `tokens_per_expert` [E] int32 =
        choices each expert served, after dropping (they sum to (1 - dropped) * k * T).

    Raises:
        ConfigError: the params and `x` disagree on sizes, or T is not a multiple of
            `group_size`.
    """
    tokens, num_experts = check_params(params, x)
    router, w1, w2 = params["router"], params["w1"], params["w2"]
    d_model = x.shape[1]
    group = cfg.group_size or tokens
    if tokens % group:
        raise ConfigError(
            f"the {tokens} tokens do not divide into groups of group_size={group}; "
            "choose a group_size that divides the tokens per step"
        )
    groups = tokens // group

    logits = jnp.einsum(
        "td,de->te", x.astype(jnp.float32), router.astype(jnp.float32), precision=_HIGHEST
    )
    capacity = expert_capacity(cfg, group, num_experts)
    routing = route(logits.reshape(groups, group, num_experts), cfg, capacity)

    # The dispatched computation holds [G, T_g, E, C] one-hot tensors: T * E * C entries,
    # so a dropless layer (C = T_g) grows with the square of the group size; group_size
    # bounds it.
    dtype = jnp.dtype(cfg.dtype)
    expert_in = jnp.einsum(
        "gtec,gtd->egcd",
        routing.dispatch.astype(dtype),
        x.reshape(groups, group, d_model).astype(dtype),
        precision=_HIGHEST,
    )
    # Expert parallelism: with E split over an `expert` mesh axis and the groups over the
    # data axes (expert axis included), the all-to-all goes here: split expert_in's E over
    # the expert axis, concatenate along G, so each device holds its own experts' slots
    # from every group. Flat: one all_to_all over the whole axis; hierarchical: gather per
    # destination slice over ICI first, then one DCN exchange per slice pair.
    hidden = jax.nn.gelu(
        jnp.einsum("egcd,edh->egch", expert_in, w1.astype(dtype), precision=_HIGHEST),
        approximate=True,
    )
    expert_out = jnp.einsum("egch,ehd->egcd", hidden, w2.astype(dtype), precision=_HIGHEST)
    # ... and its inverse here, bringing every slot's result back to its group's device.
    y = jnp.einsum("gtec,egcd->gtd", routing.combine.astype(dtype), expert_out, precision=_HIGHEST)

    first = jax.nn.one_hot(routing.experts[..., 0], num_experts, dtype=jnp.float32)
    f = jnp.mean(first, axis=(0, 1))
    p = jnp.mean(routing.probs, axis=(0, 1))
    served = jnp.sum(routing.dispatch, axis=(0, 1, 3), dtype=jnp.int32)
    choices = cfg.k * tokens
    stats = {
        "aux_loss": num_experts * jnp.sum(f * p),
        "z_loss": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
        "dropped_fraction": (choices - jnp.sum(served)).astype(jnp.float32) / choices,
        "tokens_per_expert": served,
    }
    return y.reshape(tokens, d_model).astype(x.dtype), stats


def init_params(
    key: jax.Array, d_model: int, num_experts: int, d_ff: int, dtype: str = "float32"
) -> Params:
    """Fresh MoE params: normal(0, 1/sqrt(fan_in)) router and expert weights."""
    k_router, k_w1, k_w2 = jax.random.split(key, 3)
    return {
        "router": jax.random.normal(k_router, (d_model, num_experts), dtype) * d_model**-0.5,
        "w1": jax.random.normal(k_w1, (num_experts, d_model, d_ff), dtype) * d_model**-0.5,
        "w2": jax.random.normal(k_w2, (num_experts, d_ff, d_model), dtype) * d_ff**-0.5,
    }
