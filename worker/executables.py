"""Compiled programs kept on the host, per process, so that a gang started again (after a
failure, a preemption or a controller restart, or a job submitted again) runs a program
it ran before without compiling it: ~0.1 s to read one back against 3 to 6 s to compile
the test LM's step here.

Each worker keeps its own executable, keyed by the program (content and mesh), the
gang's process count and its own process index, under `slicewise-executables/` in the
directory of `--compilation-cache` (a path on the host's filesystem; with a bucket URL
nothing is kept). JAX's persistent cache would key by process and only let process 0
write (jax/_src/compiler.py), and on CPU it is off: it reads executables back as they
were stored, and an XLA:CPU executable read back that way runs a loop's collectives in
no fixed order with the ones around it. Executables stored here for XLA:CPU are first
rewritten to keep their order (worker/thunk_order.py; docs/restarts.md says why); one
that cannot be is not stored, and its program is compiled every time.

The files are written by the workers of this deployment for themselves and read back
only by them: like JAX's own cache, a directory only the operator can write.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any

from worker import thunk_order

log = logging.getLogger(__name__)

ENV_VAR = "JAX_COMPILATION_CACHE_DIR"
# In the file names. Format 2 stored XLA:CPU executables as compiled, which read back run
# their collectives out of order: such files are never read.
FORMAT = 3


def directory() -> str:
    """Where this host keeps executables ("" for nowhere)."""
    where = os.environ.get(ENV_VAR, "")
    return "" if "://" in where else where  # a bucket: JAX's own cache only


def executable_path(where: str, program_id: str, num_processes: int, process_id: int) -> Path:
    import jax

    name = f"{program_id}-n{num_processes}-p{process_id}-jax{jax.__version__}-f{FORMAT}.executable"
    return Path(where) / "slicewise-executables" / name


def load(path: Path) -> Any | None:
    """The executable stored at `path`, loaded for this process's devices; None when
    there is none, or it cannot be read (it is compiled again then)."""
    from jax.experimental.serialize_executable import deserialize_and_load

    if not path.exists():
        return None
    try:
        data, in_tree, out_tree = pickle.loads(path.read_bytes())
        return deserialize_and_load(data, in_tree, out_tree)
    except Exception as exc:  # noqa: BLE001 - a stale or torn file: compile instead
        log.warning("cannot load the compiled program %s (%s); compiling it", path, exc)
        return None


def serialize(compiled: Any, platform: str) -> bytes:
    """`compiled` as stored: an XLA:CPU executable rewritten to keep the order of its
    collectives (worker/thunk_order.py), any other as it is.

    Raises:
        thunk_order.Unorderable: an XLA:CPU executable that cannot be rewritten so.
    """
    import jax
    from jax.experimental.serialize_executable import _JaxPjrtPickler

    class Pickler(_JaxPjrtPickler):
        def persistent_id(self, obj: Any) -> Any:
            pid = super().persistent_id(obj)
            if pid is not None and pid[0] == "exec" and platform == "cpu":
                return ("exec", thunk_order.order_collectives(pid[1])[0])
            return pid

    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None:
        raise thunk_order.Unorderable("this executable does not serialize")
    args_info, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
    with io.BytesIO() as f:
        Pickler(f).dump((unloaded, args_info, compiled._no_kwargs))
        return pickle.dumps((f.getvalue(), in_tree, compiled.out_tree))


def store(compiled: Any, path: Path, platform: str) -> None:
    """Keeps `compiled` at `path` for the next gang of this process index; a program
    whose executable cannot be kept (said in the log) is compiled again next time."""
    started = time.monotonic()
    try:
        data = serialize(compiled, platform)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_bytes(data)
        os.replace(partial, path)  # whole or not at all, for a reader in another gang
    except Exception as exc:  # noqa: BLE001 - the program runs; the next start compiles
        log.warning("cannot keep the compiled program %s: %s", path.name, exc)
        return
    log.info("kept the compiled program as %s in %.2f s", path.name, time.monotonic() - started)
