"""Exported training programs kept in the controller's state directory.

A job's init and step are exported (traced and lowered with `jax.export`) once per
(program, overrides, mesh, platform); `JobRunner` keeps them in memory, and here on disk,
so that a controller started again on the same `--state-dir` resumes its jobs without
tracing them anew (1.5-1.6 s of the small LM's recovery after a controller restart on the
2-core VM; far more for a large model).

A file is named by a digest of everything the export depends on: the program's name,
overrides, mesh and platform, the versions of jax, jaxlib and slicewise, and the source of
every module of `programs/` and of the exporting code, so that an edited program is
exported again rather than read back stale. Files are written whole (a temporary name,
then a rename); one that cannot be read is exported again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUFFIX = ".export"


@functools.cache
def code_fingerprint() -> str:
    """A digest of the source the exports come from: every module of `programs/`, and
    this package's exporting code."""
    import programs

    h = hashlib.sha256()
    roots = [Path(p) for p in programs.__path__]
    files = sorted(f for root in roots for f in root.rglob("*.py"))
    files += [Path(__file__).with_name("jobs.py"), Path(__file__)]
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def key_of(program: str, overrides: Any, mesh: Any, platform: str) -> str:
    """The file name (less its suffix) of an export."""
    import jax
    import jaxlib

    from controller.core import VERSION

    what = [program, list(map(list, overrides)), repr(mesh), platform]
    what += [jax.__version__, jaxlib.__version__, VERSION, code_fingerprint()]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]


def load(directory: Path, key: str) -> Any | None:
    """The export kept under `key`, or None (none kept, or unreadable: said in the log)."""
    path = directory / f"{key}{SUFFIX}"
    try:
        with open(path, "rb") as f:
            return pickle.load(f)  # noqa: S301 - this controller's own state directory
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - exported again instead
        log.warning("the kept export %s could not be read (%s); exporting again", path, exc)
        return None


def store(directory: Path, key: str, exported: Any) -> None:
    """Keeps an export under `key`, whole or not at all (a failure is said, not raised:
    the next start exports again)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(exported, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, directory / f"{key}{SUFFIX}")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.warning("the export could not be kept in %s (%s)", directory, exc)
