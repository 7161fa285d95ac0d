"""Byte corpora: which files, in what order, fingerprints and deterministic sampling."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from programs.corpus import SEPARATOR, STDLIB, CorpusError, corpus_files, load_corpus


def test_stdlib_corpus_is_sorted_python_source_without_tests_or_site_packages():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = corpus_files(STDLIB)
    relative = [p.relative_to(root).as_posix() for p in files]
    assert relative == sorted(relative)
    assert all(r.endswith(".py") for r in relative)
    assert "os.py" in relative and "json/__init__.py" in relative
    assert not any(
        part in ("test", "tests", "site-packages") for r in relative for part in r.split("/")
    )


def test_stdlib_corpus_loads_once_per_process():
    corpus = load_corpus(STDLIB)
    assert load_corpus(STDLIB) is corpus
    assert corpus.data.dtype == np.uint8 and len(corpus) > 1_000_000
    assert len(corpus.fingerprint) == 64


def test_glob_corpus_joins_files_with_the_separator(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world")
    (tmp_path / "a.txt").write_bytes(b"hello")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"!")
    corpus = load_corpus(str(tmp_path / "**" / "*.txt"))
    assert (
        bytes(corpus.data) == b"hello" + bytes([SEPARATOR]) + b"world" + bytes([SEPARATOR]) + b"!"
    )
    assert [Path(f).name for f in corpus.files] == ["a.txt", "b.txt", "c.txt"]

    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("a.txt", "b.txt"):
        (copy / name).write_bytes((tmp_path / name).read_bytes())
    (copy / "sub").mkdir()
    (copy / "sub" / "c.txt").write_bytes(b"!")
    # Same bytes under another prefix: hosts with different install paths still agree.
    assert load_corpus(str(copy / "**" / "*.txt")).fingerprint == corpus.fingerprint


def test_sampling_is_deterministic_and_reads_windows(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(200)))
    corpus = load_corpus(str(tmp_path / "a.txt"))
    starts = corpus.sequence_starts(seed=7, step=3, count=5, length=10)
    np.testing.assert_array_equal(starts, corpus.sequence_starts(7, 3, 5, 10))
    assert not np.array_equal(starts, corpus.sequence_starts(7, 4, 5, 10))
    assert starts.max() <= 190
    rows = corpus.read(starts, 10)
    np.testing.assert_array_equal(rows, starts[:, None] + np.arange(10))
    with pytest.raises(CorpusError, match="fewer than one sequence of 201"):
        corpus.sequence_starts(0, 0, 1, 201)


def test_a_glob_that_matches_nothing_is_refused(tmp_path):
    with pytest.raises(CorpusError, match="matched no files"):
        load_corpus(str(tmp_path / "*.nothing"))


def test_per_file_batches_give_each_file_its_block_of_rows(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"a" * 50)
    (tmp_path / "b.txt").write_bytes(b"b" * 20)
    (tmp_path / "c.txt").write_bytes(b"c" * 30)
    corpus = load_corpus(str(tmp_path / "*.txt"))
    starts = corpus.sequence_starts(seed=1, step=2, count=6, length=20, per_file=True)
    np.testing.assert_array_equal(starts, corpus.sequence_starts(1, 2, 6, 20, per_file=True))
    rows = corpus.read(starts, 20)
    # Rows 0-1 read a.txt, 2-3 b.txt (exactly its 20 bytes), 4-5 c.txt: never a separator.
    assert [bytes(set(r.tolist())) for r in rows] == [b"a", b"a", b"b", b"b", b"c", b"c"]
    assert starts[2] == starts[3] == 51  # b.txt's only window
    with pytest.raises(CorpusError, match=r"b.txt' has 20 bytes, fewer than one sequence of 21"):
        corpus.sequence_starts(0, 0, 6, 21, per_file=True)
    with pytest.raises(CorpusError, match="3 files but a batch has 2 rows"):
        corpus.sequence_starts(0, 0, 2, 5, per_file=True)
