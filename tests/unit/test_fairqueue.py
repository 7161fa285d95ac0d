"""Weighted fair interleaving of per-client queues (shared gangs)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.fairqueue import FairQueue


def drain(queue):
    out = []
    while (item := queue.pop()) is not None:
        out.append(item)
    return out


def test_backlogged_clients_are_served_in_proportion_to_their_weights():
    q = FairQueue()
    q.set_weight("a", 1)
    q.set_weight("b", 3)
    for i in range(40):
        q.push("a", ("a", i))
        q.push("b", ("b", i))
    served = [c for c, _ in drain(q)]
    window = served[:40]
    assert window.count("b") == 30 and window.count("a") == 10


def test_each_client_keeps_its_own_order():
    q = FairQueue()
    for i in range(5):
        q.push("a", i)
        q.push("b", 10 + i)
    items = drain(q)
    assert [i for c, i in items if c == "a"] == list(range(5))
    assert [i for c, i in items if c == "b"] == list(range(10, 15))


def test_an_idle_client_does_not_bank_credit():
    q = FairQueue()
    for i in range(10):
        q.push("busy", i)
    for _ in range(10):
        q.pop()
    for i in range(4):
        q.push("late", i)
        q.push("busy", 100 + i)
    served = [c for c, _ in drain(q)]
    assert served[:4].count("late") == 2  # alternates, does not get 10 turns in a row


def test_items_that_are_not_ready_wait_without_blocking_others():
    q = FairQueue()
    ready = {"x": False}
    q.push("a", "needs-x", ready=lambda: ready["x"])
    q.push("b", "free")
    assert q.pop() == ("b", "free")
    assert q.pop() is None and len(q) == 1
    ready["x"] = True
    assert q.pop() == ("a", "needs-x")


def test_weights_must_be_positive_and_drain_empties():
    q = FairQueue()
    with pytest.raises(ValueError, match="positive"):
        q.set_weight("a", 0)
    q.push("a", 1)
    q.push("b", 2)
    assert sorted(q.drain()) == [1, 2] and len(q) == 0 and q.pop() is None
    assert q.shares()["a"] == (1.0, 0, 0)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from("abcd"), st.integers(1, 5), min_size=2))
def test_service_shares_track_weights_for_any_weights(weights):
    q = FairQueue()
    for client, weight in weights.items():
        q.set_weight(client, weight)
        for i in range(60 * weight):
            q.push(client, i)
    total = sum(weights.values())
    served = [c for c, _ in (q.pop() for _ in range(20 * total))]
    for client, weight in weights.items():
        assert abs(served.count(client) - 20 * weight) <= 1
