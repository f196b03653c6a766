"""testing/listeners.py finds what a process listens on, and tells loopback from the rest: a socket bound to every
interface is caught, one on loopback is not."""

from __future__ import annotations

import os
import socket

from testing.listeners import beyond_loopback, listening


def test_a_socket_on_every_interface_is_caught_and_one_on_loopback_is_not() -> None:
    with socket.socket() as open_to_all, socket.socket() as private, socket.socket(socket.AF_INET6) as private6:
        open_to_all.bind(("0.0.0.0", 0))
        private.bind(("127.0.0.1", 0))
        private6.bind(("::1", 0))
        for sock in (open_to_all, private, private6):
            sock.listen()
        found = listening([os.getpid()])
        everywhere = f"0.0.0.0:{open_to_all.getsockname()[1]}"
        assert {everywhere, f"127.0.0.1:{private.getsockname()[1]}", f"::1:{private6.getsockname()[1]}"} <= set(found)
        assert beyond_loopback(found) == [everywhere]


def test_the_mapped_and_the_whole_loopback_range_are_loopback() -> None:
    assert beyond_loopback(["127.0.0.9:1", "::ffff:127.0.0.1:2", "::1:3", "10.0.0.1:4", ":::5"]) == [
        "10.0.0.1:4",
        ":::5",
    ]
