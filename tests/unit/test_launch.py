"""`slicewise.launch.stable_port`: a port a restarted controller can count on getting back."""

import socket
from pathlib import Path

import pytest

from slicewise.launch import stable_port


def ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_a_stable_port_is_free_and_below_the_range_outgoing_connections_take_ports_from():
    port = stable_port()
    assert 10000 <= port < ephemeral_low()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))  # free: a controller can listen there


def test_a_port_in_use_is_never_picked():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        with pytest.raises(OSError, match=f"between {taken} and {taken} in 3 tries"):
            stable_port(low=taken, high=taken, tries=3)
