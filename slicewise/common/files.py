"""Reading the end of a log file."""

from __future__ import annotations

import os


def last_lines(path: str | os.PathLike[str], lines: int, max_bytes: int | None = None) -> str:
    """The last `lines` whole lines of a file, with their line ends ("" when it is empty),
    from at most its last `max_bytes` (all of it when None). Raises OSError."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = 0 if max_bytes is None else max(0, size - max_bytes)
        f.seek(start)
        kept = f.read().decode(errors="replace").splitlines(keepends=True)
    if start:
        kept = kept[1:]  # the first may have begun before `start`
    return "".join(kept[-lines:])
