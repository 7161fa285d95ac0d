"""The `slicewise` command: run a controller, look at one, or run the demo."""

from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_ADDRESS = "127.0.0.1:50051"


def _controller(args: argparse.Namespace) -> int:
    from controller.logs import configure_logging
    from controller.server import ServerConfig, run

    configure_logging(logging.DEBUG if args.verbose else logging.INFO, args.log_format)
    try:
        config = ServerConfig(
            host=args.host, port=args.port, sim=args.sim, ray_address=args.ray_address,
            host_object_store_mb=args.host_object_store_mb,
            head_object_store_mb=args.head_object_store_mb, worker_window=args.window,
            metrics_port=args.metrics_port,
        )
    except ValueError as exc:
        print(f"slicewise controller: {exc}", file=sys.stderr)
        return 2
    return run(config)


def _status(args: argparse.Namespace) -> int:
    from controller.client import connect
    from controller.status import print_status

    try:
        client = connect(args.controller, timeout=args.timeout)
    except ConnectionError as exc:
        print(f"slicewise status: {exc}", file=sys.stderr)
        return 1
    with client:
        print_status(client.health(), client.cluster_info())
    return 0


def _trace(args: argparse.Namespace) -> int:
    import json

    from controller.client import connect
    from controller.errors import SlicewiseError

    try:
        with connect(args.controller, timeout=10) as client:
            trace = client.trace(args.id)
    except (ConnectionError, SlicewiseError) as exc:
        print(f"slicewise trace: {exc}", file=sys.stderr)
        return 1
    with open(args.output, "w") as f:
        json.dump(trace, f)
    spans = sum(1 for e in trace["traceEvents"] if e.get("ph") == "X")
    print(f"wrote {spans} spans to {args.output} (open it in https://ui.perfetto.dev)")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from controller.demo import run_demo

    return run_demo(args.sim)


def _cluster(args: argparse.Namespace) -> int:
    import signal
    import threading

    from controller.logs import configure_logging
    from controller.simcluster import SimulationProcess

    configure_logging()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sim = SimulationProcess(args.sim, host_store_mb=args.host_object_store_mb,
                            head_store_mb=args.head_object_store_mb)
    try:
        print(f"simulated cluster {args.sim} running; Ray address {sim.address}", flush=True)
        print(f"  slicewise controller --ray-address {sim.address} --port 50051", flush=True)
        stop.wait()
    finally:
        sim.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slicewise",
        description="A single-controller runtime for JAX on TPU v5e multislice clusters.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("controller", help="run a controller (with --sim: on a simulated cluster)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--sim", metavar="SPEC",
                       help="start an embedded simulated cluster, e.g. 2xv5litepod-4 or "
                            "v5litepod-16,v5litepod-4")
    where.add_argument("--ray-address", metavar="ADDR",
                       help="join an existing Ray cluster and use the TPU hosts it reports")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=50051, help="port (0 picks a free one)")
    p.add_argument("--window", type=int, default=3,
                   help="programs in flight per host before back-pressure (default %(default)s)")
    _object_store_flags(p)
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on this port (0 picks a free one)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="log lines as text or as JSON objects (default %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_controller)

    p = sub.add_parser("trace", help="write a gang's or job's timeline as Chrome/Perfetto JSON")
    p.add_argument("id", metavar="JOB", help="a job id or gang id")
    p.add_argument("-o", "--output", default="trace.json")
    p.add_argument("--controller", default=DEFAULT_ADDRESS, metavar="ADDR")
    p.set_defaults(func=_trace)

    p = sub.add_parser("status", help="show slices, hosts and gangs of a running controller")
    p.add_argument("--controller", default=DEFAULT_ADDRESS, metavar="ADDR")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_status)

    p = sub.add_parser("demo", help="start a simulated cluster and run a sharded program on it")
    p.add_argument("--sim", default="2xv5litepod-4", metavar="SPEC")
    p.set_defaults(func=_demo)

    sub.add_parser("bench", help="run benchmarks against their baselines: slicewise bench "
                                 "[--quick] [NAME ...]")

    p = sub.add_parser("cluster", help="run only a simulated Ray cluster (for --ray-address)")
    p.add_argument("--sim", required=True, metavar="SPEC")
    _object_store_flags(p)
    p.set_defaults(func=_cluster)
    return parser


def _object_store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-object-store-mb", type=int, default=1536,
                   help="Ray object store per simulated host (default %(default)s)")
    p.add_argument("--head-object-store-mb", type=int, default=3072,
                   help="Ray object store of the head node (default %(default)s)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser, so that `bench --help` and flags pass through
        from benchmarks.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
