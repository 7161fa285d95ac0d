"""Capabilities for direct transfers: signed for one op, one key and (a put) one byte
count, until a deadline; anything else is refused."""

from __future__ import annotations

import pytest

from slicewise.common import capability
from slicewise.common.capability import CapabilityError, check, issue

TOKEN = "0123456789abcdef0123456789abcdef"
NOW = 1_800_000_000.0
LATER = int(NOW) + 60


def test_a_capability_allows_what_it_was_issued_for_until_it_expires():
    put = issue(TOKEN, "put", "k1", LATER, nbytes=4096)
    assert check(TOKEN, put, "put", "k1", NOW) == capability.Grant(LATER, 4096)
    get = issue(TOKEN, "get", "k1", LATER)
    assert check(TOKEN, get, "get", "k1", NOW - 1000).nbytes == 0
    with pytest.raises(CapabilityError, match="expired"):
        check(TOKEN, get, "get", "k1", LATER)


@pytest.mark.parametrize(
    ("token", "op", "key"),
    [
        ("another gang's token", "get", "k1"),
        (TOKEN, "put", "k1"),  # a get's capability does not allow a put
        (TOKEN, "get", "k2"),  # nor a get of another key
        (TOKEN, "get", "k1 "),
    ],
)
def test_a_capability_allows_nothing_else(token, op, key):
    shown = issue(TOKEN, "get", "k1", LATER)
    with pytest.raises(CapabilityError, match="does not allow"):
        check(token, shown, op, key, NOW)


def test_changing_its_deadline_or_byte_count_breaks_the_signature():
    shown = issue(TOKEN, "put", "k1", LATER, nbytes=16)
    expires, nbytes, signature = shown.split(".")
    for forged in (
        f"{int(expires) + 3600}.{nbytes}.{signature}",
        f"{expires}.{int(nbytes) * 1000}.{signature}",
        f"{expires}.{nbytes}.{signature[:-1]}0",
    ):
        with pytest.raises(CapabilityError, match="does not allow"):
            check(TOKEN, forged, "put", "k1", NOW)


@pytest.mark.parametrize(
    "shown",
    ["", ".", "..", "abc", f"{LATER}.0", f"-1.0.{'0' * 64}", f"{LATER}.x.{'0' * 64}",
     f"{LATER}.0.{'0' * 64}.1", f"{'9' * 30}.0.{'0' * 64}", f"{LATER}.٣.{'0' * 64}"],
)  # fmt: skip
def test_malformed_capabilities_are_refused(shown):
    with pytest.raises(CapabilityError):
        check(TOKEN, shown, "get", "k1", NOW)


def test_capabilities_are_only_issued_for_puts_and_gets_with_a_token():
    with pytest.raises(ValueError, match="one of"):
        issue(TOKEN, "control", "k", LATER)
    with pytest.raises(ValueError, match="token"):
        issue("", "get", "k", LATER)
