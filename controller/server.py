"""The controller process: joins (or starts) a Ray cluster, serves gRPC, and on
SIGTERM or Ctrl-C stops every worker and simulated host it started."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.options import ControllerOptions

if TYPE_CHECKING:
    from controller.simcluster import SimulationProcess

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """How to run a controller (the `slicewise controller` flags)."""

    host: str = "127.0.0.1"
    port: int = 50051
    sim: str | None = None
    ray_address: str | None = None
    host_object_store_mb: int = 1536
    head_object_store_mb: int = 3072
    metrics_port: int | None = None
    # Cluster-wide aggregates, without tenants' ids, but unauthenticated: loopback unless
    # the operator opens them to a scraper.
    metrics_host: str = "127.0.0.1"
    options: ControllerOptions = field(default_factory=ControllerOptions)
    # Stop when standard input reaches its end: a parent that started the controller on a
    # pipe (tests, scripts) takes it down by exiting, even when killed outright.
    stop_on_stdin_eof: bool = False
    # Where the journal (jobs, their metrics, gangs) and, by default, the jobs'
    # checkpoints (<state dir>/checkpoints/<job id>) live; None: `default_state_dir`.
    state_dir: str | None = None
    # Authentication (controller/auth.py): bearer tokens from a tokens file, or none at
    # all with `insecure_local`, which only a loopback `host` may use.
    tokens_file: str | None = None
    insecure_local: bool = False
    # TLS: the server's certificate chain and key (PEM files); with a client CA bundle,
    # mutual TLS: clients must present a certificate that CA signed.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    def __post_init__(self) -> None:
        if bool(self.sim) == bool(self.ray_address):
            raise ValueError(
                "give exactly one of --sim SPEC (embedded simulation) or "
                "--ray-address ADDR (an existing Ray cluster)"
            )
        from controller.auth import is_loopback

        if self.insecure_local and self.tokens_file:
            raise ValueError("give either --tokens-file or --insecure-local, not both")
        if self.insecure_local and not is_loopback(self.host):
            raise ValueError(
                f"--insecure-local serves without authentication, so it listens only on a "
                f"loopback address, not {self.host!r}; give --tokens-file (and --tls-cert/"
                "--tls-key) to listen there"
            )
        if not (self.insecure_local or self.tokens_file):
            raise ValueError(
                "authentication is on by default: give --tokens-file FILE (make tokens with "
                "`slicewise token add`), or --insecure-local to serve without it on a "
                "loopback address"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.sim:
            from slicewise.common.topology import parse_sim_spec

            parse_sim_spec(self.sim)  # a bad spec fails here, before anything starts


def prepare_environment(ray_address: str | None) -> None:
    """Process settings that must be in place before Ray or JAX are imported."""
    # The controller only deserializes programs; it never needs an accelerator.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    host = (ray_address or "127.0.0.1").rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost"):
        # Ray would otherwise swap a loopback address for this machine's public IP and
        # then wait forever for a GCS that only listens on loopback. Ray reads this
        # setting when it is imported; if it already was, set the constant it came to.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        if "ray" in sys.modules:
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False


def default_state_dir(sim: str | None) -> Path:
    """Where a controller keeps its state when not told: a directory per user (and per
    simulated cluster, so that a restart on the same `--sim` finds its jobs and one on
    another cluster does not inherit jobs it cannot place), under $XDG_STATE_HOME."""
    root = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    if sim:
        return root / "slicewise" / f"sim-{sim.replace(',', '+').replace('/', '_')}"
    return root / "slicewise"


def lock_state_dir(state_dir: Path) -> int | None:
    """Takes the state directory for this process (an exclusive lock on
    <state_dir>/controller.lock, which the kernel drops when the process dies, however
    it dies); returns the lock's descriptor, or None if another live controller has it
    (its pid is then logged)."""
    import fcntl

    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / "controller.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        log.error(
            "state directory %s is in use by another controller (pid %s); stop it, or give "
            "this one another --state-dir",
            state_dir,
            holder,
        )
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def port_in_use(host: str, port: int) -> bool:
    """Whether a process listens on (host, port): binding it fails. SO_REUSEADDR only
    lets the probe past connections of an earlier listener that are closing; without
    SO_REUSEPORT it cannot share a port with anyone (a gRPC server sets SO_REUSEPORT
    unless told not to, and two of them would then split connections between them)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def run(config: ServerConfig) -> int:
    """Runs a controller until SIGTERM/SIGINT; returns the process exit code."""
    from controller.simcluster import SimulationProcess

    prepare_environment(config.ray_address)
    state_dir = Path(config.state_dir or default_state_dir(config.sim))
    try:  # before anything starts: a bad tokens file or certificate fails at once
        security = _security(config)
    except (OSError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    # So does a port another process listens on, before a simulation or Ray starts.
    for flag, host, port in (
        ("--port", config.host, config.port),
        ("--metrics-port", config.metrics_host, config.metrics_port),
    ):
        if port and port_in_use(host, port):
            log.error(
                "port %d on %s is in use (another controller, or another program, listens "
                "there); give this one another %s, or 0 for any free port",
                port,
                host,
                flag,
            )
            return 2
    lock = lock_state_dir(state_dir)
    if lock is None:
        return 2
    log.info("state (journal, default checkpoint directories) in %s", state_dir)
    if config.sim and not config.options.compilation_cache_dir:
        # Every simulated host is on this machine: one directory serves them all.
        cache = str(state_dir / "jax-cache")
        config = dataclasses.replace(
            config, options=dataclasses.replace(config.options, compilation_cache_dir=cache)
        )
    simulation = None
    if config.sim:
        log.info("starting simulated cluster %s", config.sim)
        simulation = SimulationProcess(
            config.sim,
            host_store_mb=config.host_object_store_mb,
            head_store_mb=config.head_object_store_mb,
        )
        # This process joins the simulation's Ray as a driver: with its token.
        os.environ.update(simulation.ray_env())
    import ray

    # Ray puts the driver's working directory on every worker's sys.path; a user's
    # directory holding a `worker.py` or `controller.py` would shadow ours there.
    workdir = tempfile.TemporaryDirectory(prefix="slicewise-controller-")
    os.chdir(workdir.name)
    try:
        ray.init(
            address=simulation.address if simulation else config.ray_address,
            namespace="slicewise",
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        address = simulation.address if simulation else str(config.ray_address)
        return asyncio.run(_serve(config, simulation, address, str(state_dir), security))
    finally:
        ray.shutdown()
        if simulation is not None:
            simulation.stop()
        workdir.cleanup()
        os.close(lock)
        log.info("controller stopped")


def _ray_token_path(simulation: Any) -> str:
    """The file holding the token this controller shows Ray: the simulation's, or the
    one the operator named (RAY_AUTH_TOKEN_PATH); empty when there is none."""
    if simulation is not None:
        return str(simulation.auth_token_path)
    if os.environ.get("RAY_AUTH_MODE") == "token":
        return os.environ.get("RAY_AUTH_TOKEN_PATH", "")
    return ""


def _security(config: ServerConfig) -> tuple[list[Any], Any, dict[str, Any]]:
    """The server's interceptors (authentication), port credentials (TLS; None for a
    plain port) and the tenants' caps.

    Raises:
        AuthConfigError: the tokens file cannot be used.
        OSError: a certificate or key file cannot be read.
    """
    import grpc

    from controller.auth import AuthInterceptor, TokenTable

    interceptors: list[Any] = []
    caps: dict[str, Any] = {}
    if config.tokens_file:
        table = TokenTable.load(config.tokens_file)
        log.info("authenticating calls: %d token(s) from %s", len(table), config.tokens_file)
        interceptors.append(AuthInterceptor(table))
        caps = table.caps
    else:
        log.warning("serving WITHOUT authentication on loopback %s (--insecure-local)", config.host)
    if not config.tls_cert:
        return interceptors, None, caps
    key, chain = Path(str(config.tls_key)).read_bytes(), Path(config.tls_cert).read_bytes()
    ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    credentials = grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=ca, require_client_auth=ca is not None
    )
    return interceptors, credentials, caps


def _stop_at_stdin_eof(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    # os.read, not sys.stdin: a daemon thread blocked inside a buffered stream holds its
    # lock, and the interpreter aborts at exit when it cannot take that lock.
    while os.read(0, 4096):
        pass
    log.info("standard input closed: the process that started this controller is gone")
    loop.call_soon_threadsafe(stop.set)


async def _serve(
    config: ServerConfig,
    simulation: SimulationProcess | None,
    ray_address: str,
    state_dir: str,
    security: tuple[list[Any], Any, dict[str, Any]],
) -> int:
    import grpc

    from controller.core import Controller
    from controller.jobs import JobRunner
    from controller.journal import Journal
    from controller.servicer import ControllerServicer, TolerantParsing
    from protos import controller_pb2_grpc as pb_grpc

    journal = Journal(Path(state_dir) / "journal.sqlite")
    controller = Controller(simulated=bool(config.sim), options=config.options, journal=journal)
    controller.simulation = simulation
    await controller.start()
    from controller.programs import warm_reader

    warm_reader()
    jobs = JobRunner(controller, journal, state_dir)
    interceptors, credentials, caps = security
    controller.manager.caps = caps
    # Authentication first: a call without a known token is refused before anything else.
    # Without SO_REUSEPORT: a second controller on this port fails to bind instead of
    # sharing it (the check in `run` is before anything starts; this one is the race).
    server = grpc.aio.server(
        interceptors=[*interceptors, TolerantParsing()], options=[("grpc.so_reuseport", 0)]
    )
    pb_grpc.add_ControllerServicer_to_server(
        ControllerServicer(
            controller,
            jobs,
            simulation_pid=simulation.pid if simulation else 0,
            ray_address=ray_address,
            ray_auth_token_path=_ray_token_path(simulation),
        ),
        server,
    )
    try:
        where = f"{config.host}:{config.port}"
        if credentials is None:
            port = server.add_insecure_port(where)
        else:
            port = server.add_secure_port(where, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        log.error(
            "port %d on %s is in use (or cannot be listened on); give this one another "
            "--port, or 0 for any free port",
            config.port,
            config.host,
        )
        await controller.shutdown()
        return 2
    if config.metrics_port is not None:
        from controller.metrics import serve_metrics

        try:
            metrics_port = serve_metrics(config.metrics_port, config.metrics_host)
        except OSError as exc:
            log.error(
                "cannot serve metrics on %s:%d (%s); give another --metrics-port, or 0 for "
                "any free port",
                config.metrics_host,
                config.metrics_port,
                exc.strerror or exc,
            )
            await controller.shutdown()
            return 2
        print(
            f"slicewise metrics on http://{config.metrics_host}:{metrics_port}/metrics",
            flush=True,
        )
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if config.stop_on_stdin_eof:
        threading.Thread(
            target=_stop_at_stdin_eof, args=(loop, stop), name="stdin-watch", daemon=True
        ).start()
    slices = len(controller.scheduler.inventory)
    resumed = jobs.resume()
    if resumed:
        print(
            f"slicewise controller: continuing {len(resumed)} unfinished job(s) from "
            f"{state_dir}: {', '.join(j.job_id for j in resumed)}",
            flush=True,
        )
    # Tests and scripts wait for this exact line (printed last, when all is up).
    print(f"slicewise controller listening on {config.host}:{port} ({slices} slices)", flush=True)
    await stop.wait()
    log.info(
        "shutting down: stopping %d job(s), releasing %d gang(s)",
        sum(not j.state.terminal for j in jobs.jobs.values()),
        len(controller.gangs),
    )
    # Jobs first, while watchers are still connected to hear that they stop.
    await jobs.shutdown(config.options.preemption_grace_s)
    await server.stop(grace=2)
    await controller.shutdown()
    journal.close()
    return 0
