"""Slice-to-slice transfer over the DCN path: a program that sends every slice's half of
an array to the other slice (`ppermute` over the slice axis: gloo over TCP between the
simulated hosts; megascale on real TPU), in GB/s for 1 MiB ... 1 GiB, against raw
loopback TCP between two processes moving the same bytes (the limit here) three ways:
the same streams as the ppermute (each process sends its half to the other over
STREAMS connections at once, from and into as much memory as the program's input and
output: the headline ratio), the same streams with every stream sending the same part
and receiving into 16 MiB of its own (the headline's baseline until 2026-12-06, mostly
served from the cache), and one socket carrying all the bytes one way."""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    RawExchange,
    RawSocketSink,
    interleaved,
    round_ratios,
    sim_controller,
    size_label,
    summarize,
    write_result,
)

SIM = "2xv5litepod-4"
# The TCP connections each simulated host sends its half over in the ppermute (gloo:
# one per device pair, measured with `ss -tnpi` around one swap).
STREAMS = 4


def swap_slices(mesh: Any) -> Any:
    import jax
    from jax.sharding import PartitionSpec as P

    def body(block: jax.Array) -> jax.Array:
        return jax.lax.ppermute(block, "slice", perm=[(0, 1), (1, 0)])

    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=P(("slice", "chip")), out_specs=P(("slice", "chip"))
        )
    )


def filled(mesh: Any, n: int) -> Any:
    """A zero-input program that makes an n-element float32 array on the gang."""
    import jax
    import jax.numpy as jnp

    return jax.jit(
        lambda: jnp.arange(n, dtype=jnp.float32), out_shardings=mesh.sharding(("slice", "chip"))
    )


def plus_one(mesh: Any) -> Any:
    """The same array's worth of output with no transfer at all: what the simulated
    devices cost to produce a fresh array of this size (the floor of any program here)."""
    import jax

    return jax.jit(lambda a: a + 1, out_shardings=mesh.sharding(("slice", "chip")))


def _median_ratio(times: dict[str, list[float]], top: str, bottom: str) -> float:
    return float(np.median(round_ratios(times, top, bottom)))


def _timed(program: Any, x: Any) -> float:
    started = time.perf_counter()
    y = program(x).block_until_ready()
    elapsed = time.perf_counter() - started
    y.delete()  # outside the timing; workers must not fill up with old outputs
    return elapsed


def run(quick: bool = False) -> dict[str, Any]:
    import slicewise

    sizes = [2**20, 16 * 2**20, 256 * 2**20] if quick else [4**k * 2**20 for k in range(6)]
    reps = 3 if quick else 5
    points = []
    with (
        sim_controller(SIM) as controller,
        slicewise.connect(controller.address) as client,
        RawSocketSink() as sink,
        RawExchange(STREAMS) as exchange,
    ):
        gang = client.allocate(slices=2, slice_type="v5litepod-4", timeout=300)
        mesh = gang.mesh(dcn={"slice": 2}, ici={"chip": 4})
        for size in sizes:
            n = size // 4
            make = gang.compile(filled(mesh, n), name=f"arange{n}")
            x = make()
            swap = gang.compile(swap_slices(mesh.abstract), x, name="swap_slices")
            y = swap(x)
            head = y.fetch()[: min(n, 8)] if size <= 16 * 2**20 else None
            if head is not None:  # the first slice now holds the second slice's half
                assert head.tolist() == list(range(n // 2, n // 2 + len(head)))
            y.delete()

            _timed(swap, x)  # first call at this size allocates its buffers
            local = gang.compile(plus_one(mesh), x, name="plus_one")
            _timed(local, x)
            payload = memoryview(np.zeros(size, np.uint8))
            exchange.swap(size // 2)  # first touch of its buffers, unmeasured
            exchange.swap(size // 2, warm=True)
            # Seconds per transfer, every path once per round (common.interleaved): each
            # ratio is the median of the rounds' ratios, as in the dispatch benchmark.
            # Measured path by path (until 2026-12-05), the 256-MiB ratio read 1.08 in
            # one run and 0.60 in the next.
            times = interleaved(
                reps,
                {
                    "slicewise": functools.partial(_timed, swap, x),
                    "raw_exchange": functools.partial(exchange.swap, size // 2),
                    "raw_exchange_warm": functools.partial(exchange.swap, size // 2, True),
                    "raw_socket": functools.partial(sink.send, payload),
                    "no_transfer": functools.partial(_timed, local, x),
                },
            )
            ours, matched, warm, raw, no_transfer = (
                summarize(times[k])
                for k in (
                    "slicewise",
                    "raw_exchange",
                    "raw_exchange_warm",
                    "raw_socket",
                    "no_transfer",
                )
            )
            x.delete()
            points.append(
                {
                    "bytes": size,
                    "slicewise_s": ours,
                    "raw_exchange_s": matched,
                    "raw_socket_s": raw,
                    "slicewise_gbps": size / ours["median"] / 1e9,
                    "raw_exchange_gbps": size / matched["median"] / 1e9,
                    "raw_socket_gbps": size / raw["median"] / 1e9,
                    "ratio": _median_ratio(times, "raw_exchange", "slicewise"),
                    "round_ratios": round_ratios(times, "raw_exchange", "slicewise"),
                    "raw_exchange_warm_s": warm,
                    "ratio_warm_exchange": _median_ratio(times, "raw_exchange_warm", "slicewise"),
                    "ratio_one_socket": _median_ratio(times, "raw_socket", "slicewise"),
                    # The same output made with no transfer (a + 1): the most any program
                    # of this size could reach against the raw exchange here.
                    "no_transfer_s": no_transfer,
                    "ratio_no_transfer": _median_ratio(times, "raw_exchange", "no_transfer"),
                }
            )
        gang.release()
    at_256 = next((p["ratio"] for p in points if p["bytes"] == 256 * 2**20), None)
    return {
        "config": {
            "sim": SIM,
            "repeats": reps,
            "path": "ppermute over the slice axis",
            "baseline": f"raw TCP exchange, {STREAMS} streams each way, each its own memory",
            "quick": quick,
        },
        "points": points,
        "ratio_at_256mib": at_256,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    points = result["points"]
    sizes = [p["bytes"] / 2**20 for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(
        sizes,
        [p["slicewise_gbps"] for p in points],
        "o-",
        label="slicewise: ppermute across slices (DCN path)",
    )
    ax.plot(
        sizes,
        [p["raw_exchange_gbps"] for p in points],
        "s--",
        label=f"raw loopback TCP, {STREAMS} streams each way",
    )
    ax.plot(sizes, [p["raw_socket_gbps"] for p in points], "^:", label="raw loopback TCP socket")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes moved (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title("slice-to-slice transfer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict[str, Any]) -> str:
    rows = [
        f"{size_label(p['bytes'])}: slicewise {p['slicewise_gbps']:.2f} GB/s, raw exchange "
        f"({STREAMS} streams each way) {p['raw_exchange_gbps']:.2f} GB/s, ratio "
        f"{p['ratio']:.2f}; against the cache-warm exchange {p['ratio_warm_exchange']:.2f}; "
        f"one raw socket {p['raw_socket_gbps']:.2f} GB/s, ratio "
        f"{p['ratio_one_socket']:.2f}; a program making the same output with no transfer "
        f"(a + 1) reaches {p['ratio_no_transfer']:.2f} of the raw exchange"
        for p in result["points"]
    ]
    return "\n".join(rows + [f"ratio at 256 MiB: {result['ratio_at_256mib']}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    result = run(parser.parse_args().quick)
    print(report(result))
    print(write_result("transfer", result, plot))


if __name__ == "__main__":
    main()
