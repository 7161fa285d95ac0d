"""Per-client FIFO queues served in weighted proportion: the share policy of a gang that
several clients attach to (Pathways-style multi-tenancy). Pure logic.

Self-clocked fair queueing (Golestani, 1994): each item gets the finish tag
`max(V, F_client) + 1 / weight`, where V is the tag of the item served last and F_client the
client's previous tag; the ready queue head with the smallest tag is served next. Backlogged
clients are served in proportion to their weights; an idle client does not bank credit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    tag: float
    item: T
    ready: Callable[[], bool] | None


@dataclass
class _Client(Generic[T]):
    weight: float = 1.0
    finish: float = 0.0
    served: int = 0
    queue: deque[_Entry[T]] = field(default_factory=deque)


class FairQueue(Generic[T]):
    """Weighted fair interleaving of per-client FIFO queues."""

    def __init__(self) -> None:
        self._clients: dict[str, _Client[T]] = {}
        self._vtime = 0.0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def set_weight(self, client: str, weight: float) -> None:
        if weight <= 0:
            raise ValueError(f"a share weight must be positive, got {weight}")
        self._clients.setdefault(client, _Client()).weight = weight

    def push(self, client: str, item: T, ready: Callable[[], bool] | None = None) -> None:
        """Queues `item` behind the client's earlier items. `ready`, if given, says when the
        item may be served (e.g. once the items producing its inputs have been)."""
        c = self._clients.setdefault(client, _Client())
        c.finish = max(self._vtime, c.finish) + 1.0 / c.weight
        c.queue.append(_Entry(c.finish, item, ready))
        self._size += 1

    def pop(self) -> tuple[str, T] | None:
        """The next item: the smallest tag among ready client heads (None if none is)."""
        best: tuple[float, str] | None = None
        for name, c in self._clients.items():
            if c.queue:
                head = c.queue[0]
                if (head.ready is None or head.ready()) and (best is None or head.tag < best[0]):
                    best = (head.tag, name)
        if best is None:
            return None
        c = self._clients[best[1]]
        entry = c.queue.popleft()
        c.served += 1
        self._size -= 1
        self._vtime = entry.tag
        return best[1], entry.item

    def drain(self) -> list[T]:
        """Removes and returns every queued item."""
        items = [e.item for c in self._clients.values() for e in c.queue]
        for c in self._clients.values():
            c.queue.clear()
        self._size = 0
        return items

    def shares(self) -> dict[str, tuple[float, int, int]]:
        """client -> (weight, items served, items queued)."""
        return {n: (c.weight, c.served, len(c.queue)) for n, c in self._clients.items()}
