"""Compiled programs kept on the host, per process, so that a gang started again (after a
failure, a preemption or a controller restart) runs a program it ran before without
compiling it.

JAX's persistent compilation cache should do this, but in a program of several processes
its key differs from process to process and only process 0 writes entries
(jax/_src/compiler.py), so every other host compiles again while process 0 waits for
it in the first collective: about 3 s of every restart of the test LM here, the largest
piece of a recovery. So each worker keeps its own compiled executable, keyed by the
program (content and mesh), the gang's process count and its own process index, in the
directory the persistent cache uses (`--compilation-cache`), next to JAX's entries.

Only a path on the host's filesystem (local or mounted) is used for this; with a bucket
URL (gs://...) only JAX's own cache is.

The files are written by the workers of this deployment for themselves and read back
only by them: like JAX's own cache, a directory only the operator can write.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_VAR = "JAX_COMPILATION_CACHE_DIR"
# In the file names: files stored before executables were compiled apart from JAX's
# persistent cache (format 1) may lack their kernels, so they are never read.
FORMAT = 2


def executable_path(directory: str, program_id: str, num_processes: int, process_id: int) -> Path:
    import jax

    name = f"{program_id}-n{num_processes}-p{process_id}-jax{jax.__version__}-f{FORMAT}.executable"
    return Path(directory) / "slicewise-executables" / name


def compile_cached(
    call: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: Any, path: Path
) -> Any:
    """The compiled `call` for these arguments: loaded from `path` when an earlier run of
    this process index stored it there, else compiled (on `mesh`) and stored."""
    import jax
    from jax.experimental.serialize_executable import deserialize_and_load, serialize

    if path.exists():
        try:
            data, in_tree, out_tree = pickle.loads(path.read_bytes())
            return deserialize_and_load(data, in_tree, out_tree)
        except Exception as exc:  # noqa: BLE001 - a stale or torn file: compile instead
            log.warning("cannot load the compiled program %s (%s); compiling it", path, exc)
    from jax._src import config as jax_config

    # Compiled here, not taken from JAX's persistent cache: an executable JAX loaded from
    # its cache serializes without its kernels (XLA:CPU, jax 0.10), and the copy stored
    # from it fails in the next process that loads it ("NOT_FOUND: Function ... not
    # found"; a first step stuck on one host, seen the same way, was most likely this).
    with jax.set_mesh(mesh), jax_config.enable_compilation_cache(False):
        compiled = call.trace(*args, **kwargs).lower().compile()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_bytes(pickle.dumps(serialize(compiled)))
        os.replace(partial, path)  # whole or not at all, for a reader in another gang
    except Exception as exc:  # noqa: BLE001 - the program runs; the next start compiles
        log.warning("cannot store the compiled program %s: %s", path, exc)
    return compiled
