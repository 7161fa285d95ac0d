"""Byte-level training corpora: files read once per process into one uint8 array, and
deterministic per-step sampling so that every host of a gang agrees on each global batch
while reading only its own rows.

The default corpus, `"stdlib"`, is the Python standard library's own `.py` files on this
machine (`sysconfig.get_paths()["stdlib"]`, recursively), sorted by path relative to that
directory, leaving out `site-packages` and every `test`, `tests` and `idle_test` directory
(test data there includes deliberately malformed, oddly encoded and generated files). Any
other spec is a file glob (`**` recurses); absolute globs are safest, since workers need
not share the controller's working directory. Files are joined with a NUL separator byte,
which text source never contains, so a sequence can see where one file ends.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from programs.base import ConfigError

STDLIB = "stdlib"
SEPARATOR = 0
VOCAB_SIZE = 256
_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


class CorpusError(ConfigError):
    """A corpus spec that names no usable data, or a read the corpus cannot serve."""


@dataclass(frozen=True, eq=False)
class Corpus:
    """The bytes of a corpus, its files and a fingerprint of its content."""

    spec: str
    files: tuple[str, ...]
    data: np.ndarray
    fingerprint: str

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def sequence_starts(self, seed: int, step: int, count: int, length: int) -> np.ndarray:
        """The start offsets of the `count` sequences of `length` bytes of batch `step`.

        Every host computes all of them (a few integers) and reads only its own rows.
        """
        if length > len(self):
            raise CorpusError(
                f"corpus {self.spec!r} has {len(self)} bytes, fewer than one sequence of "
                f"{length}; use a shorter seq_len or a larger corpus"
            )
        rng = np.random.default_rng([seed, step])
        return rng.integers(0, len(self) - length + 1, size=count, dtype=np.int64)

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The `length` bytes at each start offset, as an int32 array [len(starts), length]."""
        rows = np.empty((len(starts), length), np.int32)
        for i, start in enumerate(starts):
            rows[i] = self.data[start : start + length]
        return rows


def corpus_files(spec: str) -> list[Path]:
    """The files of a corpus spec, in corpus order.

    Raises:
        CorpusError: the spec matches no files.
    """
    if spec == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        found = [
            p
            for p in root.rglob("*.py")
            if p.is_file() and not _SKIPPED_DIRS.intersection(p.relative_to(root).parts)
        ]
        files = sorted(found, key=lambda p: p.relative_to(root).as_posix())
    else:
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
    if not files:
        raise CorpusError(
            f"corpus {spec!r} matched no files; give {STDLIB!r} or a file glob such as "
            "'/data/text/**/*.txt'"
        )
    return files


@lru_cache(maxsize=4)
def load_corpus(spec: str = STDLIB) -> Corpus:
    """Reads a corpus once per process: its files' bytes joined by SEPARATOR.

    Raises:
        CorpusError: the spec matches no files, or they are all empty.
    """
    files = corpus_files(spec)
    chunks: list[bytes] = []
    for path in files:
        chunks.append(path.read_bytes())
    joined = bytes([SEPARATOR]).join(chunks)
    if not joined.strip(bytes([SEPARATOR])):
        raise CorpusError(f"corpus {spec!r}: its {len(files)} file(s) are all empty")
    data = np.frombuffer(joined, np.uint8)
    # Content, not paths: hosts whose install prefixes differ still agree iff the bytes do.
    fingerprint = hashlib.sha256(joined).hexdigest()
    return Corpus(spec, tuple(str(p) for p in files), data, fingerprint)
