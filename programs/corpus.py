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
import os
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
    # Where each file's bytes begin in `data`, then len(data) + 1: as if a separator
    # followed the last file too, so that every file's size is the difference less one.
    bounds: tuple[int, ...] = ()

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def sequence_starts(
        self, seed: int, step: int, count: int, length: int, *, per_file: bool = False
    ) -> np.ndarray:
        """The start offsets of the `count` sequences of `length` bytes of batch `step`.

        Every host computes all of them (a few integers) and reads only its own rows. With
        `per_file`, the rows are cut into one block per file, in file order (row r of F
        files reads file `r * F // count`), and each row is a window inside its file: a data
        mixture with a fixed quota per file, and, since the batch splits over the devices
        by rows, each data-parallel block of devices sees its own files.

        Raises:
            CorpusError: the corpus (or, per file, one of its files) is shorter than
                `length`, or there are more files than rows.
        """
        rng = np.random.default_rng([seed, step])
        if not per_file:
            self._check_length(len(self), length, f"corpus {self.spec!r}")
            return rng.integers(0, len(self) - length + 1, size=count, dtype=np.int64)
        files = len(self.files)
        if files > count:
            raise CorpusError(
                f"corpus {self.spec!r} has {files} files but a batch has {count} rows; "
                "per-file batches need at least one row per file"
            )
        which = np.arange(count) * files // count
        lo = np.asarray(self.bounds[:-1], np.int64)[which]
        sizes = np.diff(np.asarray(self.bounds, np.int64)) - 1  # less the separator
        for f in np.unique(which):
            self._check_length(int(sizes[f]), length, f"corpus file {self.files[f]!r}")
        return lo + rng.integers(0, sizes[which] - length + 1, dtype=np.int64)

    def _check_length(self, size: int, length: int, what: str) -> None:
        if length > size:
            raise CorpusError(
                f"{what} has {size} bytes, fewer than one sequence of {length}; use a "
                "shorter seq_len or a larger corpus"
            )

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The `length` bytes at each start offset, as an int32 array [len(starts), length]."""
        rows = np.empty((len(starts), length), np.int32)
        for i, start in enumerate(starts):
            rows[i] = self.data[start : start + length]
        return rows


def _stdlib_files(root: Path) -> list[Path]:
    """The .py files under `root`, none under a directory of `_SKIPPED_DIRS`: those are
    never entered (site-packages alone can hold ten times the stdlib's files; walking
    it took most of a new worker's first batch)."""
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        found.extend(
            path
            for name in names
            if name.endswith(".py") and (path := Path(directory, name)).is_file()
        )
    return found


def corpus_files(spec: str) -> list[Path]:
    """The files of a corpus spec, in corpus order.

    Raises:
        CorpusError: the spec matches no files.
    """
    if spec == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(_stdlib_files(root), key=lambda p: p.relative_to(root).as_posix())
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
    bounds = np.cumsum([0] + [len(c) + 1 for c in chunks])  # each file and its separator
    return Corpus(
        spec, tuple(str(p) for p in files), data, fingerprint, tuple(int(b) for b in bounds)
    )
