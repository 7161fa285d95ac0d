"""The timelines of released gangs, kept so that a trace can still be taken after a gang
(or the job that ran on it) is gone. Pure logic.

Bounded by a number of spans, not of gangs: a gang that ran a million calls leaves at
most its share of the budget (its most recent spans), so however long a controller
serves, what it keeps of gangs it no longer holds stays the same size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from slicewise.common.trace import Span

# Spans kept for all released gangs together (a few hundred bytes each).
ARCHIVED_SPANS = 50_000

# (process name, its spans): a controller's or a worker's track of one gang.
Track = tuple[str, list[Span]]


class TimelineArchive:
    """The tracks of the most recently released gangs, at most `budget` spans in all."""

    def __init__(self, budget: int = ARCHIVED_SPANS) -> None:
        if budget < 1:
            raise ValueError(f"a timeline archive keeps at least one span, not {budget}")
        self.budget = budget
        self._gangs: OrderedDict[str, list[Track]] = OrderedDict()
        self._spans = 0

    def __len__(self) -> int:
        """The spans kept."""
        return self._spans

    def __contains__(self, gang_id: object) -> bool:
        return gang_id in self._gangs

    @property
    def gangs(self) -> int:
        return len(self._gangs)

    def share(self, tracks: int) -> int:
        """The most spans kept of each of a gang's `tracks` (so that the gang alone fits
        the budget): what to ask each of its workers for."""
        return max(1, self.budget // max(1, tracks))

    def add(self, gang_id: str, tracks: Sequence[Track]) -> None:
        """Keeps a released gang's tracks, the most recent `share(len(tracks))` spans of
        each, in place of any kept for it before; forgets the gangs released longest ago
        until the whole is within the budget."""
        share = self.share(len(tracks))
        self._drop(gang_id)
        kept = [(name, list(spans[-share:])) for name, spans in tracks]
        self._gangs[gang_id] = kept
        self._spans += sum(len(spans) for _, spans in kept)
        while self._spans > self.budget and len(self._gangs) > 1:
            self._drop(next(iter(self._gangs)))

    def get(self, gang_id: str) -> list[Track] | None:
        """The tracks kept of a released gang (None: never kept, or forgotten since)."""
        return self._gangs.get(gang_id)

    def _drop(self, gang_id: str) -> None:
        tracks = self._gangs.pop(gang_id, None)
        if tracks is not None:
            self._spans -= sum(len(spans) for _, spans in tracks)
