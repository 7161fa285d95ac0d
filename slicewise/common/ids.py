"""Gang and job ids: a number for people to read and a random part nobody can guess.

An id is `<kind><number>-<suffix>`, e.g. `g3-k4vq2mzt7xa3b` (a gang) or `j12-...` (a
job). The number counts up from 1 in the controller's journal, so ids read in the order
they were handed out and go on counting across restarts. The suffix is 13 characters of
lowercase RFC 4648 base32 (`a-z`, `2-7`) drawn from `secrets`, 65 bits: neither the
number nor any other id tells it, so an id cannot be probed for. Ids built on a gang's
keep it whole: array handles `g3-.../a1`, shared-gang attachment ids `g3-...@a2`, worker
names `slicewise-g3-...-e1-p0`, checkpoint directories `<state dir>/checkpoints/j12-...`.
"""

from __future__ import annotations

import re
import secrets

ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
SUFFIX_CHARS = 13  # 13 x 5 bits = 65 bits, more than the 64 asked of an unguessable id

ID_PATTERN = re.compile(r"(?P<kind>[a-z]+)(?P<number>[0-9]+)-(?P<suffix>[a-z2-7]{13})")
# Ids of controllers from before the suffix (`j3`) are restored from journals as they are.
_NUMBERED = re.compile(r"([a-z]+)([0-9]+)(.*)", re.S)


def unguessable_id(kind: str, number: int) -> str:
    """A new id `<kind><number>-<suffix>` with a fresh random suffix (see the module)."""
    suffix = "".join(secrets.choice(ALPHABET) for _ in range(SUFFIX_CHARS))
    return f"{kind}{number}-{suffix}"


def id_order(id_: str) -> tuple[str, int, str]:
    """Sort key that orders ids by kind, then number (`j9` before `j10`), then the rest
    (an attachment's `@a2`); any other string sorts by itself."""
    match = _NUMBERED.fullmatch(id_)
    return (match[1], int(match[2]), match[3]) if match else (id_, -1, "")
