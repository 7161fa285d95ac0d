"""The Pathways paper's micro-benchmark computations (Barham et al., 2022, section 5.1):
a trivial gang-wide computation, a scalar all-reduce plus a scalar add, optionally made
longer with per-device busy work, and its fused form (many in one program)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _busy_zero(seed: jax.Array, iters: int, size: int) -> jax.Array:
    """About `iters` matmuls of `size`^2 on this device, returning exactly 0.0."""
    h = jnp.full((size, size), 0.01, jnp.float32) + seed.reshape(-1)[0] * 1e-6
    h = jax.lax.fori_loop(0, iters, lambda _, m: jnp.tanh(m @ m) * 0.5, h)
    return jnp.minimum(jnp.sum(jnp.abs(h)), 0.0)


def allreduce_add(
    mesh: Any, axes: tuple[str, ...], *, work_iters: int = 0, work_size: int = 64
) -> Any:
    """x -> pmean(x over the whole gang) + 1, one element per device; from zeros, n calls
    give n. `work_iters` adds per-device busy work that does not change the result."""

    def body(x: jax.Array) -> jax.Array:
        out = jax.lax.pmean(x, axes) + 1.0
        return out + _busy_zero(x, work_iters, work_size) if work_iters else out

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))


def fused_allreduce_add(mesh: Any, axes: tuple[str, ...], count: int = 128) -> Any:
    """`count` all-reduce-and-adds fused into one program (the paper's "Fused")."""

    def one(_: int, v: jax.Array) -> jax.Array:
        # pmean's result is the same on every device; the loop carry must stay per-device.
        return jax.lax.pcast(jax.lax.pmean(v, axes) + 1.0, axes, to="varying")

    def body(x: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, count, one, x)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
