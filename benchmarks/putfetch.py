"""Client put / fetch throughput on the default path (large arrays straight between the
client and each host's data port, authorized by the controller) and on the path through
the controller (client -> controller over gRPC, controller -> each host over its data
port, and back), against the same bytes over a raw loopback TCP socket between two
processes, all in the same run.

Each path does one unmeasured round at each size first: the raw socket's receiver reuses
one warm buffer, while a put or fetch fills memory new to its process, and in this VM
the first touch of memory (2 MiB pages the host has not backed yet) can cost more than
the transfer (0.6 s for 128 MiB once, 27 ms after); the figures are steady state."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RawSocketSink, sim_controller, size_label, summarize, write_result

SIM = "2xv5litepod-4"
WARMUP = 1  # unmeasured rounds per path and size


def run(quick: bool = False) -> dict[str, Any]:
    import slicewise

    sizes = [2**20, 16 * 2**20, 256 * 2**20] if quick else [2**20, 16 * 2**20, 256 * 2**20, 2**30]
    reps = 2 if quick else 3
    points = []
    with (
        sim_controller(SIM) as controller,
        slicewise.connect(controller.address) as client,
        RawSocketSink() as sink,
    ):
        gang = client.allocate(slices=2, slice_type="v5litepod-4", timeout=300)
        mesh = gang.mesh(dcn={"slice": 2}, ici={"chip": 4})
        sharding = mesh.sharding(("slice", "chip"))
        for size in sizes:
            data = np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32)
            point: dict[str, Any] = {"bytes": size}
            raw = summarize([sink.send(memoryview(data).cast("B")) for _ in range(reps)])
            for path, direct in (("", True), ("proxied_", False)):
                gang.direct_data = direct
                put, fetch = round_trips(gang, data, sharding, reps)
                point |= {
                    f"{path}put_s": put,
                    f"{path}fetch_s": fetch,
                    f"{path}put_gbps": size / put["median"] / 1e9,
                    f"{path}fetch_gbps": size / fetch["median"] / 1e9,
                    f"{path}put_ratio": raw["median"] / put["median"],
                    f"{path}fetch_ratio": raw["median"] / fetch["median"],
                }
            point |= {"raw_socket_s": raw, "raw_socket_gbps": size / raw["median"] / 1e9}
            points.append(point)
        gang.release()
    return {
        "config": {
            "sim": SIM,
            "repeats": reps,
            "warmup": WARMUP,
            "sharding": "split over all 8 chips",
            "direct_min_bytes": slicewise.client.DIRECT_MIN_BYTES,
            "quick": quick,
        },
        "points": points,
    }


def round_trips(
    gang: Any, data: np.ndarray, sharding: Any, reps: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per put (until the array is ready) and per fetch of `data`, summarized,
    after one round unmeasured."""
    puts, fetches = [], []
    for _ in range(WARMUP + reps):
        started = time.perf_counter()
        remote = gang.put(data, sharding).block_until_ready()
        puts.append(time.perf_counter() - started)
        started = time.perf_counter()
        back = remote.fetch()
        fetches.append(time.perf_counter() - started)
        assert np.array_equal(back, data)
        remote.delete()
        del back
    return summarize(puts[WARMUP:]), summarize(fetches[WARMUP:])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    points = result["points"]
    sizes = [p["bytes"] / 2**20 for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(sizes, [p["put_gbps"] for p in points], "o-", label="put (direct)")
    ax.plot(sizes, [p["fetch_gbps"] for p in points], "^-", label="fetch (direct)")
    ax.plot(sizes, [p["proxied_put_gbps"] for p in points], "o:", label="put via controller")
    ax.plot(sizes, [p["proxied_fetch_gbps"] for p in points], "^:", label="fetch via controller")
    ax.plot(sizes, [p["raw_socket_gbps"] for p in points], "s--", label="raw loopback TCP")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("array size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title("client put / fetch: direct and through the controller")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict[str, Any]) -> str:
    return "\n".join(
        f"{size_label(p['bytes'])}: put {p['put_gbps']:.2f} GB/s, fetch {p['fetch_gbps']:.2f} "
        f"GB/s, raw socket {p['raw_socket_gbps']:.2f} GB/s (ratios {p['put_ratio']:.2f} / "
        f"{p['fetch_ratio']:.2f}; through the controller {p['proxied_put_ratio']:.2f} / "
        f"{p['proxied_fetch_ratio']:.2f})"
        for p in result["points"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    result = run(parser.parse_args().quick)
    print(report(result))
    print(write_result("putfetch", result, plot))


if __name__ == "__main__":
    main()
