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


# What a span recorded with `record_later` is made of when it is read: its name,
# category, thread and args.
Describe = Callable[[], tuple[str, str, str, dict[str, Any]]]


class _Later(tuple[int, int, Describe]):
    """A span not made yet: (start_us, end_us, describe), see `record_later`. A tuple,
    made by `tuple.__new__` without a Python call: one is recorded per operation, on
    the controller and on every worker."""

    __slots__ = ()

    @property
    def start_us(self) -> int:
        return self[0]

    def span(self) -> Span:
        start_us, end_us, describe = self
        name, category, thread, args = describe()
        return Span(name, category, start_us, max(0, end_us - start_us), thread, args)


_new_later = tuple.__new__


class SpanRecorder:
    """A thread-safe ring buffer of spans."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._spans: deque[Span | _Later] = deque(maxlen=capacity)
        self._lock = threading.Lock()

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

    def record_later(self, start_us: int, end_us: int, describe: Describe) -> None:
        """Records a span whose name, category, thread and args `describe()` gives when
        the span is read: on a path taken for every operation, nothing is formatted
        unless somebody reads the timeline (`describe` must not change meanwhile)."""
        with self._lock:
            self._spans.append(_new_later(_Later, (start_us, end_us, describe)))

    def spans(
        self, since_us: int = 0, where: Mapping[str, Any] | None = None, *, last: int = 0
    ) -> list[Span]:
        """Spans that started at or after `since_us` and whose args match `where`; with
        `last`, only the most recent `last` of them."""
        with self._lock:
            held = [s for s in self._spans if s.start_us >= since_us]
        spans = (s if isinstance(s, Span) else s.span() for s in held)
        found = [s for s in spans if _matches(s, where)]
        return found[-last:] if last > 0 else found

    def remove(self, where: Mapping[str, Any]) -> list[Span]:
        """Takes the spans whose args match `where` out of the buffer and returns them
        (a released gang's, so that they do not stay for as long as the buffer is not full)."""
        with self._lock:
            spans = [s if isinstance(s, Span) else s.span() for s in self._spans]
            taken = [s for s in spans if _matches(s, where)]
            if taken:
                self._spans.clear()
                self._spans.extend(s for s in spans if not _matches(s, where))
        return taken


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
