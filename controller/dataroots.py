"""Which files a job may make the workers read: its corpus must lie under one of the data
roots the controller's operator allows (`slicewise controller --data-root DIR`, repeatable).

A job's `corpus` is a file glob the workers expand and read. Without this check, a client
could have them read any file the worker processes can (keys, other tenants' data). So:

- `"stdlib"` (the Python standard library's sources) is always allowed;
- with data roots, a glob is allowed if the directory it starts from (its part before the
  first wildcard) and every file it matches, symlinks resolved, lie under a root;
- without any, an authenticated controller allows nothing else, and an `--insecure-local`
  one (loopback only: its callers are this machine's) allows every path (`None` roots).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path

from slicewise.common.errors import InvalidRequestError

_WILDCARDS = "*?["


def check_corpus(spec: str, roots: Sequence[str] | None) -> None:
    """Raises unless the job data `spec` is within `roots` (see the module docstring).

    Raises:
        InvalidRequestError: the glob reaches outside the roots, or no roots allow globs.
    """
    from programs.corpus import STDLIB

    if roots is None or spec == STDLIB:
        return
    if not roots:
        raise InvalidRequestError(
            f"corpus {spec!r}: this controller reads job data only from 'stdlib'; its "
            "operator allows directories with --data-root DIR"
        )
    resolved = [Path(os.path.realpath(r)) for r in roots]

    def inside(path: str) -> bool:
        real = Path(os.path.realpath(path))
        return any(real == root or root in real.parents for root in resolved)

    if not os.path.isabs(spec):
        raise InvalidRequestError(f"corpus {spec!r} must be an absolute path or glob")
    start = _literal_dir(spec)
    found = [start, *glob.glob(spec, recursive=True)]
    outside = [_shown(f) for f in found if not inside(f)][:3]
    if outside:
        raise InvalidRequestError(
            f"corpus {spec!r} reaches outside the data roots this controller allows "
            f"({', '.join(map(str, roots))}): {', '.join(outside)}; use data under one of "
            "them, or ask the controller's operator for another --data-root"
        )


def _shown(path: str) -> str:
    real = os.path.realpath(path)
    return path if real == os.path.abspath(path) else f"{path} (-> {real})"


def _literal_dir(spec: str) -> str:
    """The directory a glob starts from: its path up to the component with the first
    wildcard ('/data/a/*/x.txt' -> '/data/a'; a plain file's own directory)."""
    parts = Path(spec).parts
    for i, part in enumerate(parts):
        if any(c in part for c in _WILDCARDS):
            return str(Path(*parts[:i]))
    return str(Path(spec).parent)
