"""The `slicewise` command: run a controller, look at one, or run the demo."""

from __future__ import annotations

import argparse
import logging
import os
import sys

DEFAULT_ADDRESS = "127.0.0.1:50051"
# The default of `controller --compilation-cache`: one cache for every controller started
# in an environment (e.g. a test session, or several controllers on one machine).
COMPILATION_CACHE_ENV = "SLICEWISE_COMPILATION_CACHE"


def _controller(args: argparse.Namespace) -> int:
    from controller.logs import configure_logging
    from controller.options import ControllerOptions
    from controller.server import ServerConfig, run

    configure_logging(logging.DEBUG if args.verbose else logging.INFO, args.log_format)
    try:
        config = ServerConfig(
            host=args.host,
            port=args.port,
            sim=args.sim,
            ray_address=args.ray_address,
            host_object_store_mb=args.host_object_store_mb,
            head_object_store_mb=args.head_object_store_mb,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            state_dir=args.state_dir,
            stop_on_stdin_eof=args.stop_on_stdin_eof,
            tokens_file=args.tokens_file,
            insecure_local=args.insecure_local,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            options=ControllerOptions(
                worker_window=args.window,
                preemption_grace_s=args.preemption_grace,
                heartbeat_timeout_s=args.heartbeat_timeout,
                direct_transfer_ttl_s=args.direct_transfer_ttl,
                step_timeout_s=args.step_timeout,
                allow_chaos=args.allow_chaos,
                compilation_cache_dir=args.compilation_cache,
                data_roots=_data_roots(args),
            ),
        )
    except ValueError as exc:
        print(f"slicewise controller: {exc}", file=sys.stderr)
        return 2
    return run(config)


def _data_roots(args: argparse.Namespace) -> tuple[str, ...] | None:
    """--data-root directories (absolute, existing); none given: every path for a local
    controller, only the stdlib corpus for one that authenticates."""
    if not args.data_root:
        return None if args.insecure_local else ()
    for root in args.data_root:
        if not (os.path.isabs(root) and os.path.isdir(root)):
            raise ValueError(f"--data-root {root!r} must be an absolute path to a directory")
    return tuple(args.data_root)


def _token_add(args: argparse.Namespace) -> int:
    from controller.auth import TOKEN_ENV, AuthConfigError, add_token

    try:
        caps = {
            name: getattr(args, name)
            for name in ("max_chips", "max_priority", "max_queued", "max_bytes")
            if getattr(args, name) is not None
        }
        role = "admin" if args.admin else "user"
        token = add_token(args.tokens_file, args.tenant, role, caps)
    except (AuthConfigError, OSError) as exc:
        print(f"slicewise token: {exc}", file=sys.stderr)
        return 2
    print(token)
    print(
        f"(added for tenant {args.tenant!r} to {args.tokens_file}, which keeps only its "
        f"digest: store the token now; clients pass it as token= or ${TOKEN_ENV})",
        file=sys.stderr,
    )
    return 0


def _status(args: argparse.Namespace) -> int:
    from controller.status import print_status
    from slicewise.client import connect

    try:
        client = connect(args.controller, timeout=args.timeout)
    except ConnectionError as exc:
        print(f"slicewise status: {exc}", file=sys.stderr)
        return 1
    with client:
        print_status(client.health(), client.cluster_info(), client.jobs())
    return 0


def _trace(args: argparse.Namespace) -> int:
    import json

    from slicewise.client import connect
    from slicewise.common.errors import SlicewiseError

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


def _connect(args: argparse.Namespace, command: str):  # noqa: ANN202
    from slicewise.client import connect

    try:
        return connect(args.controller, name=f"slicewise {command}", timeout=args.timeout)
    except ConnectionError as exc:
        print(f"slicewise {command}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _pairs(items: list[str], what: str, convert=str) -> dict:  # noqa: ANN001
    out = {}
    for item in (p for chunk in items for p in chunk.split(",") if p):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"slicewise: {what} {item!r} is not of the form key=value")
        try:
            out[key.strip()] = convert(value.strip())
        except ValueError:
            raise SystemExit(f"slicewise: {what} {item!r}: {value!r} is not a number") from None
    return out


def _follow_job(client, job_id: str, plain: bool | None, reconnect_s: float) -> int:  # noqa: ANN001
    from controller.jobview import follow, summary
    from protos import controller_pb2 as pb
    from slicewise.common.errors import SlicewiseError

    try:
        job = follow(client.watch_job(job_id, reconnect_timeout=reconnect_s), plain=plain)
    except KeyboardInterrupt:
        print(
            f"\ndetached from {job_id}; it keeps running. Re-attach: slicewise watch "
            f"{job_id}; stop it: slicewise cancel {job_id}"
        )
        return 0
    except SlicewiseError as exc:
        print(f"slicewise: {exc}", file=sys.stderr)
        return 1
    steps = list(client.job_metrics(job_id).steps)
    print(summary(job, steps))
    return 0 if job.state == pb.JOB_STATE_SUCCEEDED else 1


def _train(args: argparse.Namespace) -> int:
    from slicewise.common.errors import SlicewiseError

    overrides = _pairs(args.set, "--set")
    dcn = _pairs(args.dcn, "--dcn", int)
    ici = _pairs(args.ici, "--ici", int)
    with _connect(args, "train") as client:
        try:
            job = client.submit_job(
                args.program,
                slices=args.slices,
                slice_type=args.slice_type,
                steps=args.steps,
                overrides=overrides,
                dcn=dcn,
                ici=ici,
                checkpoint_every=args.checkpoint_every,
                checkpoint_dir=args.checkpoint_dir,
                keep_checkpoints=args.keep_checkpoints,
                keep_steps=args.keep_step,
                max_failures=args.max_failures,
                elastic_min_slices=args.elastic,
                peer_recovery=args.peer_recovery,
                max_preemptions=args.max_preemptions,
            )
        except SlicewiseError as exc:
            print(f"slicewise train: {exc}", file=sys.stderr)
            return 1
        if args.detach:
            print(job.job_id)
            return 0
        print(
            f"submitted {job.job_id}: {args.program} on {args.slices} x {args.slice_type}, "
            f"{args.steps} steps (Ctrl-C detaches; the job keeps running)",
            flush=True,
        )
        return _follow_job(client, job.job_id, True if args.plain else None, args.reconnect)


def _watch(args: argparse.Namespace) -> int:
    with _connect(args, "watch") as client:
        return _follow_job(client, args.job, True if args.plain else None, args.reconnect)


def _logs(args: argparse.Namespace) -> int:
    from slicewise.common.errors import SlicewiseError

    if args.tail < 1:
        print(f"slicewise logs: --tail must be at least 1, got {args.tail}", file=sys.stderr)
        return 2
    with _connect(args, "logs") as client:
        source = "controller"
        try:
            for line in client.job_logs(args.job, follow=args.follow, tail=args.tail):
                if line.source != source:  # each source after the first: a heading
                    source = line.source
                    heading = (
                        "the controller, from now on"
                        if source == "controller"
                        else f"{source}: its worker's stderr (last {args.tail} lines)"
                    )
                    print(f"--- {heading} ---")
                print(line.text, flush=args.follow)
        except SlicewiseError as exc:
            print(f"slicewise logs: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
    return 0


def _keep(args: argparse.Namespace) -> int:
    from controller.jobview import checkpoint
    from slicewise.common.errors import SlicewiseError

    with _connect(args, "keep") as client:
        try:
            job = client.keep_checkpoint(args.job, args.step)
        except SlicewiseError as exc:
            print(f"slicewise keep: {exc}", file=sys.stderr)
            return 1
    print(f"{job.job_id}: step {args.step} will be kept; {checkpoint(job)}")
    return 0


def _chaos(args: argparse.Namespace) -> int:
    from slicewise.common.errors import SlicewiseError

    with _connect(args, "chaos") as client:
        try:
            message = client.inject_fault(
                args.job, args.kind, at_step=args.at_step, process=args.host
            )
        except SlicewiseError as exc:
            print(f"slicewise chaos: {exc}", file=sys.stderr)
            return 1
    print(message)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from controller.jobview import state_name
    from slicewise.common.errors import SlicewiseError

    with _connect(args, "cancel") as client:
        try:
            job = client.cancel_job(args.job)
        except SlicewiseError as exc:
            print(f"slicewise cancel: {exc}", file=sys.stderr)
            return 1
        print(f"{job.job_id}: cancelling ({state_name(job.state)} at step {job.step})")
    return 0


def _jobs(args: argparse.Namespace) -> int:
    import json

    from controller.jobview import print_jobs, summary
    from slicewise.common.errors import SlicewiseError

    with _connect(args, "jobs") as client:
        if not args.job:
            print_jobs(client.jobs())
            return 0
        try:
            metrics = client.job_metrics(args.job)
        except SlicewiseError as exc:
            print(f"slicewise jobs: {exc}", file=sys.stderr)
            return 1
        if args.json:
            from google.protobuf.json_format import MessageToDict

            print(json.dumps(MessageToDict(metrics), indent=2))
        else:
            print(summary(metrics.job, list(metrics.steps)))
            for s in metrics.steps:
                print(
                    f"step {s.step + 1:5d} loss {s.loss:.4f} grad_norm {s.grad_norm:.3f} "
                    f"lr {s.learning_rate:.2e} {1e3 * s.step_time_s:7.1f} ms "
                    f"{s.tokens_per_s:10,.0f} tok/s"
                )
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
    sim = SimulationProcess(
        args.sim, host_store_mb=args.host_object_store_mb, head_store_mb=args.head_object_store_mb
    )
    try:
        print(f"simulated cluster {args.sim} running; Ray address {sim.address}", flush=True)
        print(f"Ray authentication token in {sim.auth_token_path}", flush=True)
        env = " ".join(f"{k}={v}" for k, v in sim.ray_env().items() if v)
        print(
            f"  {env} slicewise controller --ray-address {sim.address} --insecure-local "
            "--port 50051",
            flush=True,
        )
        stop.wait()
    finally:
        sim.stop()
    return 0


def _reconnect_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--reconnect",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="if the controller goes away (restarted on the same state directory), keep "
        "re-attaching for this long; 0: give up at once (default %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slicewise",
        description="A single-controller runtime for JAX on TPU v5e multislice clusters.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("controller", help="run a controller (with --sim: on a simulated cluster)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--sim",
        metavar="SPEC",
        help="start an embedded simulated cluster, e.g. 2xv5litepod-4 or v5litepod-16,v5litepod-4",
    )
    where.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="join an existing Ray cluster and use the TPU hosts it reports",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=50051, help="port (0 picks a free one)")
    auth = p.add_argument_group("authentication (one of --tokens-file, --insecure-local)")
    auth.add_argument(
        "--tokens-file",
        metavar="FILE",
        help="accept the bearer tokens whose digests FILE holds (`slicewise token add`)",
    )
    auth.add_argument(
        "--insecure-local",
        action="store_true",
        help="serve without authentication; only on a loopback --host",
    )
    auth.add_argument(
        "--data-root",
        action="append",
        metavar="DIR",
        help="a directory jobs may read data (corpus globs) from; repeatable (default: "
        "anywhere with --insecure-local, only the stdlib corpus otherwise)",
    )
    auth.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    auth.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    auth.add_argument(
        "--tls-client-ca",
        metavar="PEM",
        help="mutual TLS: require client certificates signed by this CA bundle",
    )
    p.add_argument(
        "--window",
        type=int,
        default=3,
        help="programs in flight per host before back-pressure (default %(default)s)",
    )
    _object_store_flags(p)
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on this port (0 picks a free one)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address the metrics listen on; they have no authentication, so loopback "
        "unless a scraper elsewhere needs them (default %(default)s)",
    )
    p.add_argument(
        "--preemption-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="time a preempted gang's holder gets to save its work (default %(default)s)",
    )
    p.add_argument(
        "--direct-transfer-ttl",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long a client's direct put or fetch (straight to or from the workers) "
        "may take before its capabilities expire and what it left on the workers is "
        "dropped (default %(default)s)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a worker silent this long (it beats every 0.5 s) fails its gang, which its "
        "job then recovers (default %(default)s)",
    )
    p.add_argument(
        "--compilation-cache",
        metavar="DIR",
        default=os.environ.get(COMPILATION_CACHE_ENV, ""),
        help="where the workers keep compiled programs, a filesystem path on every host: "
        "a gang started again loads its programs instead of compiling them (default: "
        f"${COMPILATION_CACHE_ENV} if set, else <state-dir>/jax-cache with --sim, none "
        "otherwise). On TPU, also JAX's persistent compilation cache",
    )
    p.add_argument(
        "--allow-chaos",
        action="store_true",
        help="accept fault injection (slicewise chaos): it kills processes; for tests and "
        "the simulation",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="a training step stalled this long on a host (a stuck collective) fails its "
        "gang; the limit is 10x the job's slowest step when that is more "
        "(default %(default)s)",
    )
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="where the journal (jobs, metrics, gangs) and default checkpoint directories "
        "live; a controller restarted on it continues the unfinished jobs (default: "
        "$XDG_STATE_HOME/slicewise, or ~/.local/state/slicewise, with a sim-SPEC "
        "subdirectory under --sim)",
    )
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log lines as text or as JSON objects (default %(default)s)",
    )
    p.add_argument(
        "--stop-on-stdin-eof",
        action="store_true",
        help="stop when standard input closes, so that the controller never outlives the "
        "process that started it on a pipe (slicewise.testing does)",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_controller)

    p = sub.add_parser("token", help="make bearer tokens for a controller's --tokens-file")
    token_sub = p.add_subparsers(dest="token_command", required=True)
    t = token_sub.add_parser("add", help="make a token for a tenant and print it (once)")
    t.add_argument("--tokens-file", required=True, metavar="FILE")
    t.add_argument("--tenant", required=True)
    t.add_argument("--admin", action="store_true", help="the token sees and acts on everything")
    for cap, what in (
        ("max-chips", "chips its gangs may hold and ask for at once"),
        ("max-priority", "the highest priority it may ask for"),
        ("max-queued", "allocations it may have under way at once"),
        ("max-bytes", "bytes of arrays on its gangs"),
    ):
        t.add_argument(f"--{cap}", type=int, metavar="N", help=f"cap: {what}")
    t.set_defaults(func=_token_add)

    p = sub.add_parser("trace", help="write a gang's or job's timeline as Chrome/Perfetto JSON")
    p.add_argument("id", metavar="JOB", help="a job id or gang id")
    p.add_argument("-o", "--output", default="trace.json")
    p.add_argument("--controller", default=DEFAULT_ADDRESS, metavar="ADDR")
    p.set_defaults(func=_trace)

    p = sub.add_parser("status", help="show slices, hosts and gangs of a running controller")
    p.add_argument("--controller", default=DEFAULT_ADDRESS, metavar="ADDR")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_status)

    p = sub.add_parser(
        "demo",
        help="start a simulated cluster, run a sharded program on it, then a training job "
        "that loses a host and recovers by itself",
    )
    p.add_argument(
        "--sim",
        default="3xv5litepod-4",
        metavar="SPEC",
        help="the simulated cluster; a third slice is the spare the job moves to "
        "(default %(default)s)",
    )
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "train",
        help="submit a training job of an installed program and follow it (Ctrl-C detaches)",
    )
    p.add_argument("program", help="an installed program, e.g. lm (see programs/)")
    p.add_argument("--controller", default=DEFAULT_ADDRESS, metavar="ADDR")
    p.add_argument("--slices", type=int, default=1)
    p.add_argument("--slice-type", default="v5litepod-4")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. --set d_model=256 (repeatable)",
    )
    p.add_argument(
        "--dcn",
        action="append",
        default=[],
        metavar="AXIS=N",
        help="mesh axes across slices, e.g. data=2 (default: data=SLICES)",
    )
    p.add_argument(
        "--ici",
        action="append",
        default=[],
        metavar="AXIS=N",
        help="mesh axes inside a slice, e.g. fsdp=2,tensor=2 (default: fsdp=chips)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default="",
        metavar="DIR",
        help="where checkpoints go (default: <controller state dir>/checkpoints/JOB); if it "
        "holds committed steps, the job resumes from the newest",
    )
    p.add_argument(
        "--max-failures",
        type=int,
        metavar="N",
        help="gang failures (a worker or host lost) the job recovers from by itself, "
        "from its newest committed checkpoint, before it fails (default: 3)",
    )
    p.add_argument(
        "--max-preemptions",
        type=int,
        metavar="N",
        help="preemptions the job yields to and resumes from before it fails, a budget "
        "apart from --max-failures (default: no limit)",
    )
    p.add_argument(
        "--peer-recovery",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recover a lost slice from a surviving slice's replica (data parallel over "
        "slices): no step lost; keeps each in-flight step's input state on the devices "
        "(default: on whenever every slice holds a whole replica and the job is not "
        "--elastic)",
    )
    p.add_argument(
        "--elastic",
        type=int,
        metavar="MIN_SLICES",
        help="when a slice is lost and no spare is free, continue on as few as MIN_SLICES "
        "slices (same global batch) and grow back at a checkpoint once slices return",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=int,
        metavar="K",
        help="keep the newest K committed checkpoints (default: 3; 0 keeps all)",
    )
    p.add_argument(
        "--keep-step",
        type=int,
        action="append",
        default=[],
        metavar="STEP",
        help="also keep this checkpoint step (repeatable; later: slicewise keep JOB STEP)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="N",
        help="save a checkpoint every N steps and after the last (default 50; 0: never)",
    )
    p.add_argument("--detach", action="store_true", help="print the job id and return at once")
    p.add_argument("--plain", action="store_true", help="one line per step, no progress bar")
    p.add_argument("--timeout", type=float, default=10.0)
    _reconnect_flag(p)
    p.set_defaults(func=_train)

    p = sub.add_parser("watch", help="follow a running job from any terminal")
    p.add_argument("job")
    p.add_argument("--controller", default=DEFAULT_ADDRESS, metavar="ADDR")
    p.add_argument("--plain", action="store_true", help="one line per step, no progress bar")
    p.add_argument("--timeout", type=float, default=10.0)
    _reconnect_flag(p)
    p.set_defaults(func=_watch)

    p = sub.add_parser(
        "logs",
        help="a job's log: the controller's lines about it, its workers' stderr tails",
    )
    p.add_argument("job")
    p.add_argument("--controller", default=DEFAULT_ADDRESS, metavar="ADDR")
    p.add_argument(
        "-f", "--follow", action="store_true", help="then the new lines, until the job ends"
    )
    p.add_argument(
        "--tail", type=int, default=200, metavar="N", help="the newest N lines of each source"
    )
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_logs)

    p = sub.add_parser(
        "keep", help="keep a job's checkpoint step beyond its newest --keep-checkpoints"
    )
    p.add_argument("job")
    p.add_argument("step", type=int, help="a committed step still held, or one it will save")
    p.add_argument("--controller", default=DEFAULT_ADDRESS, metavar="ADDR")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_keep)

    from controller.chaos import KINDS

    p = sub.add_parser(
        "chaos",
        help="inject a fault into a running job to see it recover (controller: --allow-chaos)",
    )
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--job", required=True)
    p.add_argument(
        "--at-step", type=int, metavar="N", help="once the job has completed N steps (default: now)"
    )
    p.add_argument(
        "--host",
        type=int,
        metavar="P",
        help="the host hit, as its jax.distributed process index (default: one at random)",
    )
    p.add_argument("--controller", default=DEFAULT_ADDRESS, metavar="ADDR")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_chaos)

    p = sub.add_parser("cancel", help="stop a job and free its slices")
    p.add_argument("job")
    p.add_argument("--controller", default=DEFAULT_ADDRESS, metavar="ADDR")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_cancel)

    p = sub.add_parser("jobs", help="list jobs, or show one job's per-step metrics")
    p.add_argument("job", nargs="?", help="a job id: print its metrics")
    p.add_argument("--json", action="store_true", help="with JOB: metrics as JSON")
    p.add_argument("--controller", default=DEFAULT_ADDRESS, metavar="ADDR")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_jobs)

    sub.add_parser(
        "bench", help="run benchmarks against their baselines: slicewise bench [--quick] [NAME ...]"
    )

    p = sub.add_parser("cluster", help="run only a simulated Ray cluster (for --ray-address)")
    p.add_argument("--sim", required=True, metavar="SPEC")
    _object_store_flags(p)
    p.set_defaults(func=_cluster)
    return parser


def _object_store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host-object-store-mb",
        type=int,
        default=1536,
        help="Ray object store per simulated host (default %(default)s)",
    )
    p.add_argument(
        "--head-object-store-mb",
        type=int,
        default=3072,
        help="Ray object store of the head node (default %(default)s)",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser, so that `bench --help` and flags pass through
        from benchmarks.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
