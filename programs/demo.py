"""Small sharded programs used by the demo, the tests and the benchmarks.

Each builder takes the `AbstractMesh` a client exports against and returns a `jax.jit`
function; none of them touches a device when built or exported.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def dcn_sum_matmul(mesh: Any, dcn: str = "slice", data: str = "data", model: str = "model") -> Any:
    """`x @ w` sharded over ICI, then the per-slice row blocks summed across slices (DCN).

    x: [S*B, K], rows split over (dcn, data); w: [K, N], columns split over model.
    Returns z: [B, N] = sum over s of (x @ w)[s*B:(s+1)*B], split over (data, model). The
    psum over `dcn` is the cross-slice all-reduce.
    """

    def reduce_slices(block: jax.Array) -> jax.Array:
        return jax.lax.psum(block, dcn)

    def step(x: jax.Array, w: jax.Array) -> jax.Array:
        y = x @ w
        return jax.shard_map(
            reduce_slices, mesh=mesh, in_specs=P((dcn, data), model), out_specs=P(data, model)
        )(y)

    return jax.jit(
        step,
        in_shardings=(
            NamedSharding(mesh, P((dcn, data), None)),
            NamedSharding(mesh, P(None, model)),
        ),
        out_shardings=NamedSharding(mesh, P(data, model)),
    )


def dcn_sum_matmul_reference(x: np.ndarray, w: np.ndarray, num_slices: int) -> np.ndarray:
    """What `dcn_sum_matmul` computes, in numpy (float64 accumulation)."""
    y = x.astype(np.float64) @ w.astype(np.float64)
    return y.reshape(num_slices, -1, y.shape[-1]).sum(0)


def slow_increment(mesh: Any, size: int = 256, iters: int = 80, axis: Any = "slice") -> Any:
    """x -> x + 1 after ~`iters` matmuls of `size`^2 per device: a slow step whose answer
    is still exact, for timing asynchronous dispatch.

    The matmul chain feeds `min(sum(|tanh(h)|), 0)`, which is always 0 but which the
    compiler cannot drop, so every call really does the work.
    """

    def body(_: int, h: jax.Array) -> jax.Array:
        return jnp.tanh(h @ h) * 0.5

    def step(x: jax.Array) -> jax.Array:
        h = jnp.full((size, size), 0.01, jnp.float32) + x.reshape(-1)[0] * 1e-6
        h = jax.lax.fori_loop(0, iters, body, h)
        zero = jnp.minimum(jnp.sum(jnp.abs(h)), 0.0)
        return x + 1.0 + zero

    sharding = NamedSharding(mesh, P(axis))
    return jax.jit(step, in_shardings=(sharding,), out_shardings=sharding)
