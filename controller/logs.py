"""Structured logs: every record carries the gang and job it concerns, as text or JSON.

`log_context(gang="g3")` tags everything logged inside it, including asyncio tasks
started there (context variables follow tasks).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
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


def configure_logging(level: int = logging.INFO, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
