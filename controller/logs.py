"""Structured logs: every record carries the gang and job it concerns, as text or JSON.

`log_context(gang="g3")` tags everything logged inside it, including asyncio tasks
started there (context variables follow tasks).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_FIELDS = ("gang", "job")
_CONTEXT: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "slicewise_log_context", default=None
)


def _current() -> dict[str, str]:
    return _CONTEXT.get() or {}


@contextmanager
def log_context(**fields: str) -> Iterator[None]:
    token = _CONTEXT.set({**_current(), **{k: v for k, v in fields.items() if v}})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def set_log_context(**fields: str) -> None:
    """Tags the rest of the current task (use in a task's body, not across awaits of others)."""
    _CONTEXT.set({**_current(), **{k: v for k, v in fields.items() if v}})


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _current().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, gang, job, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _FIELDS:
            if getattr(record, key, None):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    """Plain lines, with `[gang=g1 job=j2]` when the record has them."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        tags = " ".join(f"{k}={getattr(record, k)}" for k in _FIELDS if getattr(record, k, None))
        return f"{line} [{tags}]" if tags else line


class JobLog(logging.Handler):
    """The controller's lines about each job (the records tagged with it), the newest
    `keep` per job for the newest `jobs` jobs, for `slicewise logs JOB`; a follower gets
    each new line as it comes. Kept in memory: a restarted controller starts anew."""

    def __init__(self, keep: int = 2000, jobs: int = 1000) -> None:
        super().__init__()
        self.setFormatter(TextFormatter())
        self.addFilter(_ContextFilter())
        self._keep, self._jobs = keep, jobs
        self._lines: OrderedDict[str, deque[tuple[int, str]]] = OrderedDict()
        self._followers: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Queue]]] = {}
        self._seq = 0
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        job = getattr(record, "job", None)
        if not job:
            return
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - as logging.Handler does: never raise from a log call
            self.handleError(record)
            return
        with self._guard:
            self._seq += 1
            entry = (self._seq, line)
            kept = self._lines.get(job)
            if kept is None:
                kept = self._lines[job] = deque(maxlen=self._keep)
                while len(self._lines) > self._jobs:
                    self._lines.popitem(last=False)
            kept.append(entry)
            followers = list(self._followers.get(job, ()))
        for loop, queue in followers:
            with contextlib.suppress(RuntimeError):  # its loop has closed
                loop.call_soon_threadsafe(queue.put_nowait, entry)

    def lines(self, job: str) -> list[tuple[int, str]]:
        """(sequence number, line) of the job's kept lines, oldest first."""
        with self._guard:
            return list(self._lines.get(job, ()))

    @contextmanager
    def following(self, job: str) -> Iterator[asyncio.Queue[tuple[int, str]]]:
        """A queue that gets each line logged about the job from now on."""
        queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        follower = (asyncio.get_running_loop(), queue)
        with self._guard:
            self._followers.setdefault(job, set()).add(follower)
        try:
            yield queue
        finally:
            with self._guard:
                self._followers.get(job, set()).discard(follower)
                if not self._followers.get(job):
                    self._followers.pop(job, None)


# The controller process's book of job lines (attached by `configure_logging`).
JOB_LOG = JobLog()


def configure_logging(level: int = logging.INFO, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler, JOB_LOG]
    root.setLevel(level)
