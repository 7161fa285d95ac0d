"""A small decoder-only transformer over bytes in plain JAX, and how its weights split
over a mesh.

Params are nested dicts of float32 arrays; the layers are stacked on a leading axis and
run with `lax.scan`, which keeps compile time flat in depth. Each layer is pre-RMSNorm
causal multi-head attention then a GELU MLP; positions are learned; the output
projection is separate from the embedding.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from programs.base import ConfigError, ParallelAxes
from programs.corpus import VOCAB_SIZE
from programs.lm.config import LMConfig

Params = dict[str, Any]
_EPS = 1e-6


def init_params(config: LMConfig, key: jax.Array) -> Params:
    """Fresh float32 parameters: scaled normals, unit norms, small output projection.

    All normals come from one draw, sliced: XLA on CPU compiles each separate draw for
    about half a second, and a separate draw per weight made init compile for seconds.
    The price is that the draw is as large as the model on every device before it is
    sharded, which is nothing at this program's sizes.
    """
    d, h, k, f, n = (config.d_model, config.n_heads, config.head_dim, config.d_ff, config.n_layers)
    # Residual-branch outputs shrink with depth so the stream's scale stays ~1 at init.
    out_std = (2 * n) ** -0.5
    normals = {
        "embed": ((VOCAB_SIZE, d), 1.0),
        "pos": ((config.seq_len, d), 0.1),
        "wq": ((n, d, h, k), d**-0.5),
        "wk": ((n, d, h, k), d**-0.5),
        "wv": ((n, d, h, k), d**-0.5),
        "wo": ((n, h, k, d), out_std * d**-0.5),
        "w_in": ((n, d, f), d**-0.5),
        "w_out": ((n, f, d), out_std * f**-0.5),
        "unembed": ((d, VOCAB_SIZE), 0.02),
    }
    sizes = [math.prod(shape) for shape, _ in normals.values()]
    draw = jax.random.normal(key, (sum(sizes),), jnp.float32)
    pieces = jnp.split(draw, list(itertools.accumulate(sizes))[:-1])
    w = {
        name: piece.reshape(shape) * std
        for (name, (shape, std)), piece in zip(normals.items(), pieces, strict=True)
    }
    return {
        "embed": w["embed"],
        "pos": w["pos"],
        "layers": {
            "attn_norm": jnp.ones((n, d), jnp.float32),
            "wq": w["wq"],
            "wk": w["wk"],
            "wv": w["wv"],
            "wo": w["wo"],
            "mlp_norm": jnp.ones((n, d), jnp.float32),
            "w_in": w["w_in"],
            "w_out": w["w_out"],
        },
        "final_norm": jnp.ones((d,), jnp.float32),
        "unembed": w["unembed"],
    }


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + _EPS) * scale


def _layer(x: jax.Array, p: Params) -> tuple[jax.Array, None]:
    t = x.shape[1]
    h = _rms_norm(x, p["attn_norm"])
    q = jnp.einsum("btd,dhk->bthk", h, p["wq"])
    k = jnp.einsum("btd,dhk->bthk", h, p["wk"])
    v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k) * q.shape[-1] ** -0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    attended = jnp.einsum("bhqs,bshk->bqhk", weights, v)
    x = x + jnp.einsum("bqhk,hkd->bqd", attended, p["wo"])
    h = _rms_norm(x, p["mlp_norm"])
    x = x + jax.nn.gelu(h @ p["w_in"]) @ p["w_out"]
    return x, None


def logits(config: LMConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Next-byte logits [B, T, 256] for int tokens [B, T] (T <= seq_len)."""
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    x, _ = jax.lax.scan(_layer, x, params["layers"])
    return _rms_norm(x, params["final_norm"]) @ params["unembed"]


def loss(config: LMConfig, params: Params, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of `batch["tokens"]` [B, seq_len + 1]."""
    tokens = batch["tokens"]
    log_probs = jax.nn.log_softmax(logits(config, params, tokens[:, :-1]), axis=-1)
    picked = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)
    return -jnp.mean(picked)


def param_partition(config: LMConfig, params_shape: Params, axes: ParallelAxes) -> Params:
    """FSDP over d_model and Megatron tensor parallelism over heads, d_ff and vocab.

    Attention q/k/v and the MLP input are column-parallel (heads / d_ff over `tensor`),
    their outputs row-parallel, so each layer needs one reduction per branch. Embedding
    and output projection split the vocabulary over `tensor`. Every weight's d_model
    dimension splits over `fsdp`. Norm scales are tiny and replicated.

    Raises:
        ConfigError: d_model, n_heads, d_ff or the vocabulary does not divide its axis.
    """
    fsdp, tensor = axes.fsdp, axes.tensor
    for field, value, axis in (
        ("d_model", config.d_model, fsdp),
        ("n_heads", config.n_heads, tensor),
        ("d_ff", config.d_ff, tensor),
        ("the byte vocabulary", VOCAB_SIZE, tensor),
    ):
        ways = axes.size(axis)
        if value % ways:
            kind = "FSDP" if axis == fsdp else "tensor-parallel"
            raise ConfigError(
                f"{field}={value} does not divide over the {kind} mesh axis {axis!r} of "
                f"size {ways}; pick {field} as a multiple of {ways} or a smaller {axis!r} axis"
            )
    del params_shape  # the layout is fixed by the config; shapes are checked by the caller
    return {
        "embed": P(tensor, fsdp),
        "pos": P(None, fsdp),
        "layers": {
            "attn_norm": P(),
            "wq": P(None, fsdp, tensor, None),
            "wk": P(None, fsdp, tensor, None),
            "wv": P(None, fsdp, tensor, None),
            "wo": P(None, tensor, None, fsdp),
            "mlp_norm": P(),
            "w_in": P(None, fsdp, tensor),
            "w_out": P(None, tensor, fsdp),
        },
        "final_norm": P(),
        "unembed": P(fsdp, tensor),
    }
