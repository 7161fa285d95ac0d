"""The workers' kept executables (worker/executables.py) and the rewrite that keeps an
XLA:CPU executable's order of collectives when it is read back (worker/thunk_order.py),
on real compiled programs: a scan over layers with its weights sharded over 8 devices
(collectives in the loop and around it, as the LM's step has them)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.serialize_executable import deserialize_and_load
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from worker import executables, thunk_order

TIMEOUT_S = 180
LAYERS, WIDTH, ROWS = 3, 64, 16


def scan_step():
    """A jitted FSDP step over a scan of layers on a 2 x 4 mesh, and its arguments."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    layers = NamedSharding(mesh, P(None, "fsdp", None))
    rows = NamedSharding(mesh, P(("data", "fsdp"), None))

    def loss(w, x):
        h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
        return jnp.mean(h**2)

    def step(w, x):
        value, grad = jax.value_and_grad(loss)(w, x)
        return w - 0.5 * grad, value

    call = jax.jit(step, in_shardings=(layers, rows), out_shardings=(layers, None))
    rng = np.random.default_rng(0)
    w = jax.device_put(rng.standard_normal((LAYERS, WIDTH, WIDTH), np.float32) * 0.2, layers)
    x = jax.device_put(rng.standard_normal((ROWS, WIDTH), np.float32), rows)
    return call, w, x


def compilation_result(raw: bytes):
    """The CompilationResultProto of an XLA:CPU executable serialized by jaxlib."""
    size, start = thunk_order._varint(raw, 0)
    _, i = thunk_order._varint(raw, start + size)
    length, i = thunk_order._varint(raw, i)
    return thunk_order.message_class("xla.cpu.CompilationResultProto").FromString(
        raw[i : i + length]
    )


def sequences(sequence):
    yield sequence
    for thunk in sequence.thunks:
        for nested in thunk_order._nested(thunk):
            yield from sequences(nested)


def test_a_kept_executable_chains_every_collective_to_the_next_and_computes_the_same():
    call, w, x = scan_step()
    compiled = call.trace(w, x).lower().compile()
    rewritten, added = thunk_order.order_collectives(compiled.runtime_executable().serialize())
    result = compilation_result(rewritten)

    checked = 0
    for sequence in sequences(result.thunk_sequence):
        thunks = list(sequence.thunks)
        runners = [
            i
            for i, t in enumerate(thunks)
            if thunk_order.runs_collectives(t) and not t.info.op_name.startswith("slicewise")
        ]
        for a, b in zip(runners, runners[1:], strict=False):
            order = thunks[b - 1]  # put right before the second
            assert order.info.op_name.startswith("slicewise-order."), order.info.op_name
            copies = order.call_thunk.called_sequence.thunks
            touched = [
                (
                    c.copy_thunk.dst_buffer_shape.slice.buffer_allocation_index,
                    c.copy_thunk.dst_buffer_shape.slice.offset,
                )
                for c in copies
            ]
            assert touched == [
                thunk_order._element(thunks[a])[:2],
                thunk_order._element(thunks[b])[:2],
            ]
            assert all(
                c.copy_thunk.src_buffer_shape == c.copy_thunk.dst_buffer_shape for c in copies
            )
            checked += 1
        # Resource groups still name collective thunks (their indices moved with them).
        for group in sequence.thunk_resources:
            assert all(thunk_order.runs_collectives(thunks[i]) for i in group.thunk_indices)
    loops = [
        t for s in sequences(result.thunk_sequence) for t in s.thunks if t.HasField("while_thunk")
    ]
    assert loops and any(thunk_order.runs_collectives(t) for t in loops)
    assert checked >= 2 and added >= checked

    kept = deserialize_and_load(*pickle.loads(executables.serialize(compiled, "cpu")))
    w1, w2 = w, w
    for _ in range(4):
        w1, loss1 = compiled(w1, x)
        w2, loss2 = kept(w2, x)
        assert float(loss1) == float(loss2)
    assert np.array_equal(np.asarray(w1), np.asarray(w2))


def test_a_program_without_collectives_is_kept_as_compiled():
    compiled = jax.jit(lambda a: jnp.tanh(a) * 2).trace(jnp.ones((4, 4))).lower().compile()
    raw = compiled.runtime_executable().serialize()
    assert thunk_order.order_collectives(raw) == (raw, 0)


def test_what_cannot_be_ordered_says_so():
    with pytest.raises(thunk_order.Unorderable, match="not an"):
        thunk_order.order_collectives(b"\x02ab\x12\x00")
    collective = thunk_order.message_class("xla.cpu.ThunkProto")(kind="collective")
    collective.collective_thunk.all_reduce_thunk.SetInParent()
    collective.info.op_name = "all-reduce.3"
    assert thunk_order.runs_collectives(collective)
    with pytest.raises(thunk_order.Unorderable, match="all-reduce.3"):
        thunk_order._element(collective)


# Keeps (or loads) the scan step under `path`, then runs it 3 times and prints the loss.
SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import jax
    jax.config.update("jax_enable_compilation_cache", False)
    sys.path.insert(0, sys.argv[2])
    from test_executables import scan_step
    from worker import executables

    path = Path(sys.argv[1])
    call, w, x = scan_step()
    compiled = executables.load(path)
    print("loaded" if compiled is not None else "compiled")
    if compiled is None:
        compiled = call.trace(w, x).lower().compile()
        executables.store(compiled, path, "cpu")
    for _ in range(3):
        w, loss = compiled(w, x)
    print(repr(float(loss)))
    """
)


def run(path):
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), os.path.dirname(__file__)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_what_one_process_keeps_the_next_loads_and_runs_alike(tmp_path):
    path = tmp_path / "keep" / "step.executable"
    first = run(path)
    assert first[0] == "compiled" and path.exists()
    second = run(path)
    assert second == ["loaded", first[1]]


def test_an_unreadable_kept_file_is_compiled_again(tmp_path):
    path = tmp_path / "torn.executable"
    path.write_bytes(b"not a pickle")
    assert executables.load(path) is None
    assert executables.load(tmp_path / "absent.executable") is None
