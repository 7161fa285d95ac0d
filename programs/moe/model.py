"""The `moe` model: the `lm` decoder with every `moe_every`-th feed-forward block an MoE
layer, and how its weights split over a mesh.

Params: the `lm` model's embeddings, attention (stacked over all layers, with each layer's
pre-FFN norm) and output projection; `dense` holds the MLPs of the layers without experts
(stacked; absent when every layer has experts) and `moe` the MoE layers' router [D, E] and
experts w1 [E, D, H], w2 [E, H, D] (stacked over the MoE layers). The layers run in a
Python loop: depth is small here, and the MoE layers differ from the dense ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from programs.base import ConfigError, ParallelAxes
from programs.lm import model as lm
from programs.moe.config import MoEConfig
from programs.moe.layer import moe_layer
from programs.moe.sharded import ExpertParallelism, sharded_moe_layer

Params = dict[str, Any]
# (params of one MoE layer, tokens [T, D]) -> (y [T, D], stats)
MoEFn = Callable[[Params, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]
# What every step reports per MoE layer (stacked over the layers, in layer order).
STATS = ("dropped_fraction", "local_fraction", "tokens_by_slice", "tokens_per_expert")


def init_params(config: MoEConfig, key: jax.Array) -> Params:
    """Fresh float32 parameters, scaled as the `lm` model's; experts like its MLPs."""
    d, n = config.d_model, config.n_layers
    e, x, m = config.n_experts, config.d_expert, config.n_moe_layers
    out_std = (2 * n) ** -0.5
    # The lm model's weights (MLPs for the layers without experts), the experts drawn
    # just before the output projection.
    shared = lm.normals(config, mlp_layers=n - m)
    unembed = shared.pop("unembed")
    normals = {
        **shared,
        "router": ((m, d, e), d**-0.5),
        "w1": ((m, e, d, x), d**-0.5),
        "w2": ((m, e, x, d), out_std * x**-0.5),
        "unembed": unembed,
    }
    w = lm.draw_normals(key, normals)
    params: Params = {
        "embed": w["embed"],
        "pos": w["pos"],
        "layers": {
            "attn_norm": jnp.ones((n, d), jnp.float32),
            **{name: w[name] for name in ("wq", "wk", "wv", "wo")},
            "mlp_norm": jnp.ones((n, d), jnp.float32),
        },
        "moe": {name: w[name] for name in ("router", "w1", "w2")},
        "final_norm": jnp.ones((d,), jnp.float32),
        "unembed": w["unembed"],
    }
    if n > m:
        params["dense"] = {"w_in": w["w_in"], "w_out": w["w_out"]}
    if config.router_skew:
        params["embed"], params["moe"]["router"] = _skew(
            config, jax.random.fold_in(key, 1), params["embed"], params["moe"]["router"]
        )
    return params


def _skew(
    config: MoEConfig, key: jax.Array, embed: jax.Array, router: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The `router_skew` instrument: byte values [256 e / E, 256 (e + 1) / E) get a shared
    direction u_e in their embeddings, and expert e's router column gets u_e too, so that a
    token prefers the experts of its byte range. With data whose bytes differ by slice (see
    `per_file_rows`), each slice then routes to its own experts: the skewed routing that
    load-aware placement fixes. The directions are orthonormal (random ones when E > D);
    `router_skew` 1 gives them the length of a typical embedding row and router column.
    The other weights are drawn as without it."""
    d, e = router.shape[1], router.shape[2]
    drawn = jax.random.normal(key, (d, e), jnp.float32)
    columns: list[jax.Array] = []
    for j in range(e):  # Gram-Schmidt, not jnp.linalg.qr: its LAPACK call crashed workers
        v = drawn[:, j]
        for u in columns if e <= d else ():
            v = v - jnp.dot(u, v) * u
        columns.append(v / jnp.linalg.norm(v))
    directions = jnp.stack(columns, axis=1)
    vocab = embed.shape[0]
    expert_of_byte = jnp.arange(vocab) * e // vocab
    row = jnp.mean(jnp.linalg.norm(embed, axis=1))
    column = jnp.mean(jnp.linalg.norm(router, axis=1))
    skew = config.router_skew
    embed = embed + skew * row * directions.T[expert_of_byte]
    return embed, router + skew * column * directions[None]


def forward(
    config: MoEConfig, params: Params, tokens: jax.Array, moe_fn: MoEFn
) -> tuple[jax.Array, list[dict[str, jax.Array]]]:
    """Next-byte logits [B, T, 256] for int tokens [B, T], and each MoE layer's stats."""
    x = lm.embed(params, tokens)
    b, t, d = x.shape
    layer_stats = []
    dense = moe = 0
    for i in range(config.n_layers):
        p = jax.tree.map(lambda a, i=i: a[i], params["layers"])
        x = lm.attention(x, p)
        if config.is_moe(i):
            q = jax.tree.map(lambda a, j=moe: a[j], params["moe"])
            y, stats = moe_fn(q, lm.rms_norm(x, p["mlp_norm"]).reshape(b * t, d))
            x = x + y.reshape(b, t, d)
            layer_stats.append(stats)
            moe += 1
        else:
            w = jax.tree.map(lambda a, j=dense: a[j], params["dense"])
            x = lm.mlp(x, {"mlp_norm": p["mlp_norm"], **w})
            dense += 1
    return lm.head(params, x), layer_stats


def loss_and_stats(
    config: MoEConfig, params: Params, batch: dict[str, jax.Array], moe_fn: MoEFn
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy plus the weighted load-balancing and z-losses of all MoE layers, and
    the routing of each (`STATS`, stacked over the MoE layers)."""
    tokens = batch["tokens"]
    logits, layer_stats = forward(config, params, tokens[:, :-1], moe_fn)
    loss = (
        lm.next_byte_loss(logits, tokens[:, 1:])
        + config.aux_loss_weight * sum(s["aux_loss"] for s in layer_stats)
        + config.z_loss_weight * sum(s["z_loss"] for s in layer_stats)
    )
    for s in layer_stats:  # unsharded: one slice, where every expert is
        s.setdefault("local_fraction", jnp.float32(1.0))
        s.setdefault("tokens_by_slice", s["tokens_per_expert"][None])
    stats = {name: jnp.stack([s[name] for s in layer_stats]).astype(jnp.float32) for name in STATS}
    return loss, stats


def expert_movers(params: Params, order: jax.Array) -> Any:
    """A tree shaped like `params` whose leaves are functions: each moves its leaf's experts
    as `permute_experts` does, and leaves without experts as they are. Optimizer states
    hold trees shaped like the params (Adam's moments), which move with the same functions
    (see `MoEProgram.permute_experts`).
    """

    def take(axis: int) -> Callable[[jax.Array], jax.Array]:
        # Stacked over the MoE layers: layer l's slice takes `order[l]` along `axis`.
        return lambda a: jax.vmap(lambda w, o: jnp.take(w, o, axis=axis - 1))(a, order)

    movers = jax.tree.map(lambda _: lambda a: a, params)
    movers["moe"] = {"router": take(2), "w1": take(1), "w2": take(1)}
    return movers


def permute_experts(params: Params, order: jax.Array) -> Params:
    """The same model with its experts renumbered: MoE layer l's expert e becomes the one
    that was `order[l, e]` (router column, w1 and w2 together). Where an expert runs
    follows its number (the expert axes split E into blocks), so this is how experts move
    between devices and slices, and it computes what it did: routing picks experts by
    probability and slots are claimed per expert in token order, so only the numbering of
    `tokens_per_expert` changes (and float sums over experts, in their order).

    `order` is int [n_moe_layers, E], a permutation per layer.
    """
    return jax.tree.map(lambda move, a: move(a), expert_movers(params, order), params)


def expert_parallelism(config: MoEConfig, axes: ParallelAxes) -> ExpertParallelism | None:
    """Where the experts and tokens of each MoE layer go on a mesh with `axes`: experts over
    the `expert` axis, and the `fsdp` axis too when `experts_over_fsdp`; tokens over the
    batch axes. None when no axis splits the experts (they are then replicated).

    Raises:
        ConfigError: hierarchical dispatch without both an expert and an fsdp axis.
    """
    fsdp = axes.fsdp if config.experts_over_fsdp else None
    expert_axes = tuple(a for a in (axes.expert, fsdp) if a)
    if config.dispatch != "flat" and not (axes.expert and fsdp):
        raise ConfigError(
            f"dispatch={config.dispatch} needs an 'expert' mesh axis across slices (e.g. --dcn "
            "expert=2) and an 'fsdp' axis inside them with experts_over_fsdp=true; use "
            "dispatch=flat otherwise"
        )
    if not expert_axes:
        return None
    return ExpertParallelism(
        expert_axes=expert_axes,
        data_axes=tuple(a for a in axes.batch if a not in expert_axes),
        strategy=config.dispatch,  # type: ignore[arg-type]  # checked by the config
        expert_slices=max(1, math.prod(axes.slices(a) for a in expert_axes)),
        chunk=config.dcn_chunk,
    )


def moe_fn_for(config: MoEConfig, mesh: Any, axes: ParallelAxes | None) -> MoEFn:
    """The MoE layer to call: sharded with expert parallelism on a mesh, plain on one
    device (or when no axis splits the experts)."""
    layer = config.layer
    ep = None if mesh is None or axes is None else expert_parallelism(config, axes.bind(mesh))
    if ep is None:
        return lambda p, x: moe_layer(p, x, layer)
    return lambda p, x: sharded_moe_layer(p, x, layer, mesh, ep)


def param_partition(config: MoEConfig, axes: ParallelAxes) -> Params:
    """The `lm` model's layout for what it shares; experts split over the expert axes
    (see `expert_parallelism`), routers replicated.

    Raises:
        ConfigError: a dimension does not divide over its axes.
    """
    lm.check_divides(config, axes)
    ep = expert_parallelism(config, axes)
    experts = P(None, ep.expert_axes if ep else None, None, None)
    if ep is not None:
        ways = math.prod(axes.size(a) for a in ep.expert_axes)
        if config.n_experts % ways:
            raise ConfigError(
                f"n_experts={config.n_experts} does not split over the {ways} devices of mesh "
                f"axes {list(ep.expert_axes)}; use a multiple of {ways} experts"
            )
    mlp = lm.mlp_partition(axes)
    specs: Params = {
        **lm.outer_partition(axes),
        "layers": {**lm.attention_partition(axes), "mlp_norm": P()},
        "moe": {"router": P(), "w1": experts, "w2": experts},
    }
    if config.n_layers > config.n_moe_layers:
        specs["dense"] = {"w_in": mlp["w_in"], "w_out": mlp["w_out"]}
    return specs
