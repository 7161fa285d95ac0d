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
    d, n = config.d_model, config.n_layers
    w = draw_normals(key, normals(config, mlp_layers=n))
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


def normals(config: LMConfig, mlp_layers: int) -> dict[str, tuple[tuple[int, ...], float]]:
    """(shape, std) of every normal weight of the model, in draw order: embeddings,
    attention stacked over all layers, MLPs stacked over `mlp_layers`, output projection.
    Residual-branch outputs shrink with depth so the stream's scale stays ~1 at init."""
    d, h, k, f, n = (config.d_model, config.n_heads, config.head_dim, config.d_ff, config.n_layers)
    out_std = (2 * n) ** -0.5
    return {
        "embed": ((VOCAB_SIZE, d), 1.0),
        "pos": ((config.seq_len, d), 0.1),
        "wq": ((n, d, h, k), d**-0.5),
        "wk": ((n, d, h, k), d**-0.5),
        "wv": ((n, d, h, k), d**-0.5),
        "wo": ((n, h, k, d), out_std * d**-0.5),
        "w_in": ((mlp_layers, d, f), d**-0.5),
        "w_out": ((mlp_layers, f, d), out_std * f**-0.5),
        "unembed": ((d, VOCAB_SIZE), 0.02),
    }


def draw_normals(
    key: jax.Array, normals: dict[str, tuple[tuple[int, ...], float]]
) -> dict[str, jax.Array]:
    """float32 normal(0, std) arrays of the given shapes, sliced from one draw (see
    `init_params` for why one)."""
    sizes = [math.prod(shape) for shape, _ in normals.values()]
    draw = jax.random.normal(key, (sum(sizes),), jnp.float32)
    pieces = jnp.split(draw, list(itertools.accumulate(sizes))[:-1])
    return {
        name: piece.reshape(shape) * std
        for (name, (shape, std)), piece in zip(normals.items(), pieces, strict=True)
    }


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + _EPS) * scale


def attention(x: jax.Array, p: Params) -> jax.Array:
    """The residual stream [B, T, D] after one pre-norm causal attention block (`p`: one
    layer's attn_norm, wq, wk, wv, wo)."""
    t = x.shape[1]
    h = rms_norm(x, p["attn_norm"])
    q = jnp.einsum("btd,dhk->bthk", h, p["wq"])
    k = jnp.einsum("btd,dhk->bthk", h, p["wk"])
    v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k) * q.shape[-1] ** -0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    attended = jnp.einsum("bhqs,bshk->bqhk", weights, v)
    return x + jnp.einsum("bqhk,hkd->bqd", attended, p["wo"])


def mlp(x: jax.Array, p: Params) -> jax.Array:
    """The residual stream after one pre-norm GELU MLP block (`p`: mlp_norm, w_in, w_out)."""
    h = rms_norm(x, p["mlp_norm"])
    return x + jax.nn.gelu(h @ p["w_in"]) @ p["w_out"]


def _layer(x: jax.Array, p: Params) -> tuple[jax.Array, None]:
    return mlp(attention(x, p), p), None


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """The residual stream [B, T, D] of int tokens [B, T]: byte and position embeddings."""
    return params["embed"][tokens] + params["pos"][: tokens.shape[1]]


def head(params: Params, x: jax.Array) -> jax.Array:
    """Next-byte logits [B, T, 256] of the final residual stream."""
    return rms_norm(x, params["final_norm"]) @ params["unembed"]


def next_byte_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy (nats) of `logits` [B, T, V] against int `targets` [B, T]."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


def logits(config: LMConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Next-byte logits [B, T, 256] for int tokens [B, T] (T <= seq_len)."""
    x, _ = jax.lax.scan(_layer, embed(params, tokens), params["layers"])
    return head(params, x)


def loss(config: LMConfig, params: Params, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of `batch["tokens"]` [B, seq_len + 1]."""
    tokens = batch["tokens"]
    return next_byte_loss(logits(config, params, tokens[:, :-1]), tokens[:, 1:])


def param_partition(config: LMConfig, params_shape: Params, axes: ParallelAxes) -> Params:
    """FSDP over d_model and Megatron tensor parallelism over heads, d_ff and vocab.

    Attention q/k/v and the MLP input are column-parallel (heads / d_ff over `tensor`),
    their outputs row-parallel, so each layer needs one reduction per branch. Embedding
    and output projection split the vocabulary over `tensor`. Every weight's d_model
    dimension splits over `fsdp`. Norm scales are tiny and replicated.

    Raises:
        ConfigError: d_model, n_heads, d_ff or the vocabulary does not divide its axis.
    """
    check_divides(config, axes)
    del params_shape  # the layout is fixed by the config; shapes are checked by the caller
    return {
        **outer_partition(axes),
        "layers": {**attention_partition(axes), **mlp_partition(axes)},
    }


def check_divides(config: LMConfig, axes: ParallelAxes) -> None:
    """Raises ConfigError unless d_model, n_heads, d_ff and the vocabulary divide over
    the FSDP and tensor-parallel axes that split them."""
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


def outer_partition(axes: ParallelAxes) -> Params:
    """Specs of the embeddings, final norm and output projection (see `param_partition`)."""
    fsdp, tensor = axes.fsdp, axes.tensor
    return {
        "embed": P(tensor, fsdp),
        "pos": P(None, fsdp),
        "final_norm": P(),
        "unembed": P(fsdp, tensor),
    }


def attention_partition(axes: ParallelAxes) -> Params:
    """Specs of the attention weights stacked over layers (leading layer dimension)."""
    fsdp, tensor = axes.fsdp, axes.tensor
    return {
        "attn_norm": P(),
        "wq": P(None, fsdp, tensor, None),
        "wk": P(None, fsdp, tensor, None),
        "wv": P(None, fsdp, tensor, None),
        "wo": P(None, tensor, None, fsdp),
    }


def mlp_partition(axes: ParallelAxes) -> Params:
    """Specs of the MLP weights stacked over layers (leading layer dimension)."""
    fsdp, tensor = axes.fsdp, axes.tensor
    return {"mlp_norm": P(), "w_in": P(None, fsdp, tensor), "w_out": P(None, tensor, fsdp)}
