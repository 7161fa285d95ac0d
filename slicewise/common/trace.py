"""Timeline spans, kept in bounded memory by the controller and by every worker, and
merged into one Chrome / Perfetto trace (`slicewise trace JOB -o trace.json`).

Times are wall-clock microseconds, so spans recorded by different processes of one
machine line up; across machines they are as good as the hosts' clocks.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Keep the last this-many spans per process: a long job keeps its recent history.
DEFAULT_CAPACITY = 200_000


def now_us() -> int:
    return time.time_ns() // 1000


@dataclass(frozen=True)
class Span:
    """One interval on one thread of one process."""

    name: str
    category: str
    start_us: int
    duration_us: int
    thread: str = "main"
    args: Mapping[str, Any] = field(default_factory=dict)


# How spans recorded with `record_later` are described when read: given the span's
# fields, its name, category, thread and args.
Describe = Callable[..., tuple[str, str, str, dict[str, Any]]]


class SpanRecorder:
    """A thread-safe ring buffer of spans.

    The spans of operations (one per operation, on the controller and on every worker)
    are kept as plain tuples of numbers and strings, `(start_us, end_us, describer,
    *fields)`, and made into `Span`s only when read (`record_later`). Such a tuple is
    not tracked by Python's cyclic collector once a collection has seen it: a ring of
    200,000 spans held as objects (a Span or a `functools.partial` each, with what they
    point to) is half a million to a million objects that every full collection walks,
    tens to hundreds of milliseconds each on the 2-core simulation, in the controller
    and in every worker, during a stream of short calls.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._spans: deque[Span | tuple[Any, ...]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._describers: list[Describe] = []
        self._codes: dict[Describe, int] = {}

    def describer(self, describe: Describe) -> int:
        """The code `record_later` takes for spans that `describe(*fields)` describes
        (the same code for the same function, or an equal bound method)."""
        with self._lock:
            code = self._codes.get(describe)
            if code is None:
                code = self._codes[describe] = len(self._describers)
                self._describers.append(describe)
            return code

    def record(
        self,
        name: str,
        category: str,
        start_us: int,
        end_us: int,
        *,
        thread: str = "main",
        **args: Any,
    ) -> None:
        span = Span(name, category, start_us, max(0, end_us - start_us), thread, args)
        with self._lock:
            self._spans.append(span)

    def record_later(self, start_us: int, end_us: int, describer: int, *fields: Any) -> None:
        """Records a span whose name, category, thread and args the function registered
        as `describer` (see `describer`) gives for `fields` when the span is read: on a
        path taken for every operation, nothing is formatted unless somebody reads the
        timeline. Give `fields` as numbers, strings, None and tuples of those, so that
        the collector stops tracking the span (see the class's docstring)."""
        with self._lock:
            self._spans.append((start_us, end_us, describer, *fields))

    def spans(
        self, since_us: int = 0, where: Mapping[str, Any] | None = None, *, last: int = 0
    ) -> list[Span]:
        """Spans that started at or after `since_us` and whose args match `where`; with
        `last`, only the most recent `last` of them."""
        with self._lock:
            held = [s for s in self._spans if _start_us(s) >= since_us]
        spans = (self._span(s) for s in held)
        found = [s for s in spans if _matches(s, where)]
        return found[-last:] if last > 0 else found

    def remove(self, where: Mapping[str, Any]) -> list[Span]:
        """Takes the spans whose args match `where` out of the buffer and returns them
        (a released gang's, so that they do not stay for as long as the buffer is not full)."""
        with self._lock:
            spans = [self._span(s) for s in self._spans]
            taken = [s for s in spans if _matches(s, where)]
            if taken:
                self._spans.clear()
                self._spans.extend(s for s in spans if not _matches(s, where))
        return taken

    def _span(self, held: Span | tuple[Any, ...]) -> Span:
        if isinstance(held, Span):
            return held
        start_us, end_us, code, *fields = held
        name, category, thread, args = self._describers[code](*fields)
        return Span(name, category, start_us, max(0, end_us - start_us), thread, args)


def _start_us(held: Span | tuple[Any, ...]) -> int:
    return held.start_us if isinstance(held, Span) else held[0]


def _matches(span: Span, where: Mapping[str, Any] | None) -> bool:
    return all(span.args.get(k) == v for k, v in (where or {}).items())


def chrome_trace(processes: Sequence[tuple[str, Iterable[Span]]]) -> dict[str, Any]:
    """Chrome trace-event JSON (loads in Perfetto and chrome://tracing): one track per
    process, named, with one thread row per span thread."""
    events: list[dict[str, Any]] = []
    for pid, (process_name, spans) in enumerate(processes):
        events.append(
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process_name}}
        )
        threads: dict[str, int] = {}
        for span in spans:
            tid = threads.setdefault(span.thread, len(threads))
            events.append(
                {
                    "name": span.name,
                    "cat": span.category,
                    "ph": "X",
                    "ts": span.start_us,
                    "dur": span.duration_us,
                    "pid": pid,
                    "tid": tid,
                    "args": dict(span.args),
                }
            )
        for thread, tid in threads.items():
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}}
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
