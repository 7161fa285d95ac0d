"""The workers' store of compiled programs (worker/executables.py), across real processes
sharing one compilation cache directory: what one process stores, the next one loads and
runs, also when JAX's own persistent cache already held the program."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

TIMEOUT_S = 120

# Stores (or loads) a program's executable under `path`, with JAX's persistent cache in
# `cache`, then runs it and prints its outputs' sums.
SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import numpy as np

    from worker import executables

    cache, path, warm = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "warm"
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    def f(x, w):
        y = jnp.tanh(x @ w)
        return y[:, :8].reshape(-1), jnp.sum(y[::2, 1:5])

    call = jax.jit(f)
    args = (jnp.ones((16, 32)), jnp.full((32, 32), 0.01))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    if warm:  # JAX's persistent cache gets the program first
        call.trace(*args).lower().compile()
    compiled = executables.compile_cached(call, args, {}, mesh, path)
    print(*(float(np.asarray(o).sum()) for o in compiled(*args)))
    """
)


def run(*argv):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


@pytest.mark.parametrize("jax_cache", ["cold", "warm"])
def test_what_one_process_stores_the_next_loads_and_runs(tmp_path, jax_cache):
    cache, path = str(tmp_path / "cache"), str(tmp_path / "cache" / "p.executable")
    stored = run(cache, path, jax_cache)
    assert (tmp_path / "cache" / "p.executable").exists()
    assert run(cache, path, "cold") == stored
