"""A job's corpus must lie under the controller's data roots (controller/dataroots.py)."""

from __future__ import annotations

import os

import pytest

from controller.dataroots import check_corpus
from slicewise.common.errors import InvalidRequestError


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.txt").write_text("x")
    (tmp_path / "secret.txt").write_text("s")
    return tmp_path, root


def test_globs_under_a_root_and_the_stdlib_are_allowed(tree):
    _, root = tree
    for spec in (f"{root}/a/*.txt", f"{root}/**/*.txt", f"{root}/a/x.txt", "stdlib"):
        check_corpus(spec, (str(root),))
    check_corpus("stdlib", ())
    check_corpus("/etc/*", None)  # a loopback-only controller: its callers are local


@pytest.mark.parametrize("spec", ["{tmp}/*.txt", "{root}/../secret.txt", "{root}/../*", "/etc/*"])
def test_globs_reaching_outside_are_refused(tree, spec):
    tmp, root = tree
    with pytest.raises(InvalidRequestError, match="reaches outside the data roots"):
        check_corpus(spec.format(tmp=tmp, root=root), (str(root),))


def test_a_symlink_out_of_a_root_is_refused(tree):
    tmp, root = tree
    os.symlink(tmp / "secret.txt", root / "a" / "leak.txt")
    with pytest.raises(InvalidRequestError, match=r"secret.txt"):
        check_corpus(f"{root}/a/*.txt", (str(root),))


def test_without_roots_only_the_stdlib_and_paths_must_be_absolute(tree):
    _, root = tree
    with pytest.raises(InvalidRequestError, match="only from 'stdlib'; its operator allows"):
        check_corpus(f"{root}/a/*.txt", ())
    with pytest.raises(InvalidRequestError, match="must be an absolute path"):
        check_corpus("data/*.txt", (str(root),))
