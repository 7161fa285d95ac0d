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
STATS = ("dropped_fraction", "local_fraction", "tokens_per_expert")


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
    return params


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
    one = jnp.float32(1.0)  # unsharded: every expert is on the token's slice
    stats = {
        name: jnp.stack([s.get(name, one) for s in layer_stats]).astype(jnp.float32)
        for name in STATS
    }
    return loss, stats


def expert_parallelism(config: MoEConfig, axes: ParallelAxes) -> ExpertParallelism | None:
    """Where the experts and tokens of each MoE layer go on a mesh with `axes`: experts over
    the `expert` axis, and the `fsdp` axis too when `experts_over_fsdp`; tokens over the
    batch axes. None when no axis splits the experts (they are then replicated).

    Raises:
        ConfigError: hierarchical dispatch without both an expert and an fsdp axis.
    """
    fsdp = axes.fsdp if config.experts_over_fsdp else None
    expert_axes = tuple(a for a in (axes.expert, fsdp) if a)
    if config.dispatch == "hierarchical" and not (axes.expert and fsdp):
        raise ConfigError(
            "dispatch=hierarchical needs an 'expert' mesh axis across slices (e.g. --dcn "
            "expert=2) and an 'fsdp' axis inside them with experts_over_fsdp=true; use "
            "dispatch=flat otherwise"
        )
    if not expert_axes:
        return None
    return ExpertParallelism(
        expert_axes=expert_axes,
        data_axes=tuple(a for a in axes.batch if a not in expert_axes),
        strategy="hierarchical" if config.dispatch == "hierarchical" else "flat",
        expert_slices=max(1, math.prod(axes.slices(a) for a in expert_axes)),
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
