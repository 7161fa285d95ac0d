"""The worker's buffer table: what an operation's inputs and outputs go through."""

import pytest

from worker.buffers import BufferTable, UnknownHandleError


def test_an_operations_inputs_come_in_order_and_its_outputs_are_stored_by_handle():
    table = BufferTable()
    table.put_all(("a", "b", "c"), [1, 2, 3])
    assert table.get_all(("c", "a", "b", "a")) == [3, 1, 2, 1]
    assert table.get("b") == 2
    assert table.get_all(()) == []
    assert len(table) == 3


def test_a_missing_or_failed_input_is_named():
    table = BufferTable()
    table.put_all(("a",), [1])
    table.fail(("f",), "the step that makes it ran out of memory")
    with pytest.raises(UnknownHandleError, match="array gone is not on this worker"):
        table.get_all(("a", "gone"))
    with pytest.raises(RuntimeError, match="array f is unavailable: the step that makes it ran"):
        table.get("f")


def test_outputs_that_do_not_match_their_handles_are_refused():
    table = BufferTable()
    with pytest.raises(ValueError, match="2 handles for 1 arrays"):
        table.put_all(("a", "b"), [1])
    assert len(table) == 0
