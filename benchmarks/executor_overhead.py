"""What the worker's executor costs per operation beyond a bare loop, in one process.

`slicewise bench dispatch` shows the workers' executor thread spending 60-80 us more CPU
per call than the same program run by the workers' own loop (perf on 2026-12-05: the
interpreter 63 against 14 us per operation, the kernel 57 against 39). This measures
that surplus without Ray, the controller or a second process, so that a change to the
hot path can be judged in a minute: one process with the 8 CPU devices of two simulated
v5litepod-4 hosts runs the dispatch benchmark's all-reduce program

  own loop  - `JaxRuntime.run_loop`, as the multi-controller baseline does;
  executor  - the same calls as ExecOps through `InOrderExecutor` and `JaxRuntime.apply`,
              with a DeleteOp for every 16 outputs dropped (as a client's dropped arrays
              arrive), a span recorded for later and a completion queued as columns per
              operation (as worker/actor.py does; no control channel);
  minimal   - a loop of a dozen lines doing what the executor must: look the inputs up,
              call the program, keep at most the window in flight, note each completion;

in alternating rounds (benchmarks.common.interleaved), and prints each one's CPU per
operation on the thread that runs it and in the whole process, and each way's thread
CPU beyond the own loop's as the median of the rounds' differences (steadier than the
difference of the medians here). The program is compiled ahead and called as the
executable itself, as a simulated gang's workers call it (they get a compilation cache
directory; `JaxRuntime._execute`'s `direct`).

    python -m benchmarks.executor_overhead [--ops 1000] [--rounds 6] [--work-iters 0]

Measured 2026-12-05 on the 2-core VM, 40 rounds: the executor's thread spent 44.6 us
per operation beyond the own loop's, the minimal loop 4.2 us (with 6 or 12 rounds,
runs of the same code read 39 to 71 us for the executor). Two trims, each worth 5-10 us
in a stripped-down loop, made no difference measurable here: the buffer table without
its lock, and an input's layout told by `is` after the first call (both together, 40
rounds, minutes later: 43.4 us; not kept). In `timeit` each saves a few hundred
nanoseconds; in place the executor pays several times its straight-line Python (about
15 us in `timeit`) per operation, and with the collector off it spent about 9 us less.
"""

from __future__ import annotations

import argparse
import functools
import os
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from benchmarks.common import cpu_seconds, interleaved

WINDOW = 3  # as the workers' (worker/actor.py DEFAULT_WINDOW)
DELETE_EVERY = 16
WAYS = ("own loop", "executor", "minimal")


def _thread_ns(tid: int) -> int:
    """CPU nanoseconds a thread of this process has used (schedstat: finer than ticks)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


class _Measured:
    """Runs a way's body; its CPU per op on the thread that does the work (the body's own
    thread, or `tid`: the executor's) and in the whole process, and its rate."""

    def __init__(self) -> None:
        self.results: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}

    def run(self, way: str, ops: int, body: Any, tid: int | None = None) -> float:
        box: dict[str, int] = {}

        def target() -> None:
            worker = threading.get_native_id() if tid is None else tid
            before = _thread_ns(worker)
            body()
            box["ns"] = _thread_ns(worker) - before

        process, started = cpu_seconds(os.getpid()), time.perf_counter()
        thread = threading.Thread(target=target, name=way)
        thread.start()
        thread.join()
        wall = time.perf_counter() - started
        per_op = box["ns"] / 1e3 / ops
        process_per_op = 1e6 * (cpu_seconds(os.getpid()) - process) / ops
        self.results[way].append((per_op, process_per_op, ops / wall))
        return per_op


def run(ops: int = 1000, rounds: int = 6, work_iters: int = 0) -> dict[str, Any]:
    """CPU per operation of each way, the medians of `rounds` alternating rounds."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from programs.microbench import allreduce_add
    from slicewise.common.mesh import GangShape, MeshSpec, ShardingSpec
    from slicewise.common.ops import DeleteOp, ExecOp, LoadOp
    from slicewise.common.trace import SpanRecorder
    from worker.executor import InOrderExecutor
    from worker.runtime import JaxRuntime

    axes = ("slice", "chip")
    mesh = MeshSpec.build({"slice": 2}, {"chip": 4})
    runtime = JaxRuntime(GangShape(2, 1, 4), 0, window=WINDOW)
    runtime._devices = sorted(jax.devices(), key=lambda d: d.id)  # one process: all local
    split = runtime.named_sharding(ShardingSpec(mesh, (axes,)))
    runtime.buffers.put("x0", jax.device_put(np.zeros(8, np.float32), split))
    aval = jax.ShapeDtypeStruct(
        (8,), jnp.float32, sharding=NamedSharding(mesh.abstract(), PartitionSpec(axes))
    )
    program = allreduce_add(mesh.abstract(), axes, work_iters=work_iters)
    serialized = bytes(jax.export.export(program, platforms=["cpu"])(aval).serialize())
    runtime.apply(LoadOp(1, "p", serialized, mesh, "allreduce_add"))
    # A worker compiles a program ahead when it is loaded, and its calls go to that
    # executable itself (`_Program.direct`): so does this runtime.
    runtime.apply(ExecOp(2, "p", ("x0",), ("x",))).wait()
    assert runtime._programs["p"].direct is not None, "the program was not compiled ahead"

    # The worker's on_done, less the channel: a span for later and a completion in columns.
    spans = SpanRecorder()
    columns: tuple[list[int], list[int], list[int]] = ([], [], [])
    last_done = threading.Event()
    last_seq = [0]
    errors: list[str] = []

    def describe(seq: int) -> tuple[str, str, str, dict[str, Any]]:
        return "op", "execute", "programs", {"seq": seq}

    op_spans = spans.describer(describe)

    def on_done(
        op: Any, launched: int, started: int, finished: int, error: Any, values: Any
    ) -> None:
        spans.record_later(started // 1000, finished // 1000, op_spans, op.seq)
        if error is not None:
            errors.append(f"operation {op.seq}: {error}")
        columns[0].append(op.seq)
        columns[1].append(started)
        columns[2].append(finished)
        if op.seq == last_seq[0]:
            last_done.set()

    def on_idle() -> None:
        for column in columns:
            column.clear()

    executor = InOrderExecutor(
        runtime.apply, window=WINDOW, first_seq=3, on_done=on_done, on_idle=on_idle
    )
    next_seq = [3]
    measured = _Measured()

    def own_loop() -> None:
        runtime.run_loop("p", ["x"], ops, WINDOW)

    def through_executor() -> None:
        batch: list[Any] = []
        previous, dropped = "x", []
        for i in range(ops):
            seq = next_seq[0]
            output = f"y{seq}"
            batch.append(ExecOp(seq, "p", (previous,), (output,)))
            if i:  # the first input stays: the next round starts from it
                dropped.append(previous)
            previous = output
            next_seq[0] += 1
            if len(dropped) == DELETE_EVERY:
                batch.append(DeleteOp(next_seq[0], tuple(dropped)))
                dropped = []
                next_seq[0] += 1
        batch.append(DeleteOp(next_seq[0], (*dropped, previous)))
        last_seq[0] = next_seq[0]
        next_seq[0] += 1
        last_done.clear()
        executor.enqueue(batch)
        if not last_done.wait(600):
            raise TimeoutError("the executor did not finish the round in 10 minutes")
        if errors:  # a round of failed calls measures nothing
            raise RuntimeError(f"{len(errors)} operations failed, the first {errors[0]}")

    def minimal() -> None:
        arrays = runtime.buffers._arrays  # the table itself: no lock, no checks
        call = functools.partial(JaxRuntime._call, runtime._programs["p"])
        in_flight: deque[tuple[int, Any]] = deque()
        done: list[tuple[int, int]] = []
        previous = "x"
        for i in range(ops):
            output = f"m{i}"
            (arrays[output],) = call([arrays[previous]])
            in_flight.append((i, arrays[output]))
            if i:
                del arrays[previous]
            previous = output
            if len(in_flight) > WINDOW:
                seq, array = in_flight.popleft()
                array.block_until_ready()
                done.append((seq, time.time_ns()))
        for _, array in in_flight:
            array.block_until_ready()
        del arrays[previous]

    interleaved(
        rounds,
        {
            "own loop": functools.partial(measured.run, "own loop", ops, own_loop),
            "executor": functools.partial(
                measured.run, "executor", ops, through_executor, executor._thread.native_id
            ),
            "minimal": functools.partial(measured.run, "minimal", ops, minimal),
        },
    )
    executor.stop()
    executor._watcher.join(timeout=10)  # it ends once told to, with nothing in flight
    # The arrays go before the interpreter ends: freed during its shutdown, after XLA's
    # threads, one aborted the process ("terminate called ... exception not rethrown").
    runtime.buffers.delete(("x0", "x"))
    spans.remove({})
    # Each way's thread CPU beyond the own loop's, the median of the rounds' differences:
    # two ways of a round ran moments apart, so the VM's drift mostly cancels.
    own = np.array([r[0] for r in measured.results["own loop"]])
    beyond = {
        way: float(np.median(np.array([r[0] for r in values]) - own))
        for way, values in measured.results.items()
        if way != "own loop"
    }
    return {
        "ops": ops,
        "rounds": rounds,
        "work_iters": work_iters,
        "window": WINDOW,
        "median": {
            way: dict(
                zip(
                    ("thread_us_per_op", "process_us_per_op", "ops_per_s"),
                    (float(v) for v in np.median(np.array(values), axis=0)),
                    strict=True,
                )
            )
            for way, values in measured.results.items()
        },
        "beyond_own_loop_us_per_op": beyond,
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['ops']} ops x {result['rounds']} rounds, window {result['window']}, "
        f"work_iters {result['work_iters']} (medians):"
    ]
    for way, m in result["median"].items():
        lines.append(
            f"  {way:9s} {m['thread_us_per_op']:6.1f} us/op on its thread, "
            f"{m['process_us_per_op']:6.1f} us/op in the process, {m['ops_per_s']:6.0f} ops/s"
        )
    lines.append(
        "  beyond the own loop on their threads (median of the rounds' differences): "
        + ", ".join(
            f"{way} {us:+.1f} us/op" for way, us in result["beyond_own_loop_us_per_op"].items()
        )
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--work-iters", type=int, default=0)
    args = parser.parse_args()
    # Before jax loads: the devices of two simulated hosts, with the hosts' own flags.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false"
    )
    print(report(run(args.ops, args.rounds, args.work_iters)))


if __name__ == "__main__":
    main()
