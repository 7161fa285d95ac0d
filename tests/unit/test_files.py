"""The end of a log file, as the test helpers and the controller show it."""

from __future__ import annotations

from slicewise.common.files import last_lines
from slicewise.testing import log_tail


def test_the_last_lines_of_a_whole_file_keep_their_line_ends(tmp_path):
    log = tmp_path / "controller.log"
    log.write_text("a\nb\nc\n")
    assert last_lines(log, 2) == "b\nc\n"
    assert last_lines(log, 10) == "a\nb\nc\n"


def test_log_tail_says_when_there_is_no_log_or_nothing_in_it(tmp_path):
    log = tmp_path / "controller.log"
    assert log_tail(log).startswith("(no log: ")
    log.write_text("")
    assert log_tail(log) == "(the log is empty)"
    log.write_text("".join(f"{i}\n" for i in range(50)))
    assert log_tail(log) == "".join(f"{i}\n" for i in range(10, 50))
