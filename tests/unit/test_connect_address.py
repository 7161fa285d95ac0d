"""What `slicewise.connect` says about an address nothing can be reached at: a malformed
one is refused before any connection, a port nothing listens on is "connection refused"
at once, not after the call's whole timeout, and a port that does not answer yet is
waited on, saying so. Real sockets on loopback; no controller."""

from __future__ import annotations

import logging
import socket

import pytest

import slicewise
from slicewise.client import parse_address

# Long enough that a client which waited out its timeout would fail these tests by the
# message it gives ("no slicewise controller answers ... after 600 s"), and by pytest's
# per-test timeout long before that.
LONG_S = 600.0


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("127.0.0.1", "has no port"),
        ("127.0.0.1:notaport", "'notaport' is not a port"),
        ("127.0.0.1:70000", "'70000' is not a port"),
        (":50051", "has no port"),
        ("http://127.0.0.1:50551", "has a scheme (http://)"),
        ("grpc://127.0.0.1:50551", "(here '127.0.0.1:50551')"),
    ],
)
def test_a_malformed_address_is_refused_saying_what_is_wrong(address, says):
    with pytest.raises(slicewise.AddressError, match="give it as host:port") as caught:
        slicewise.connect(address, timeout=LONG_S)
    assert says in str(caught.value)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, ConnectionError)


def test_well_formed_addresses_parse():
    assert parse_address("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert parse_address("[::1]:8080") == ("::1", 8080)
    assert parse_address("ctl.example:443") == ("ctl.example", 443)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_port_nothing_listens_on_is_connection_refused_at_once():
    port = free_port()
    with pytest.raises(ConnectionError, match=f"connection refused at 127.0.0.1:{port}"):
        slicewise.connect(f"127.0.0.1:{port}", timeout=LONG_S)


def test_a_port_that_does_not_answer_is_waited_on_and_the_wait_said(caplog):
    # A listening socket nobody accepts on speaks no gRPC: the client waits its timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with (
            caplog.at_level(logging.WARNING, logger="slicewise.client"),
            pytest.raises(ConnectionError, match="no slicewise controller answers"),
        ):
            slicewise.connect(address, timeout=3.0)
    assert any(
        f"waiting for the slicewise controller at {address}" in r.getMessage()
        for r in caplog.records
    )
