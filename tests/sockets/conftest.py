"""The services the socket tests talk to, each served in a thread of the test's process (stopped and closed after)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic_control_plane.bus.config import Timing
from elastic_control_plane.services.discovery.service import DiscoveryService
from elastic_control_plane.services.notifier.service import NotifierService
from elastic_control_plane.services.rendezvous.service import RendezvousService
from testing.harness import free_ports, serve_in_thread


@pytest.fixture
def notifier() -> Iterator[NotifierService]:
    ports = free_ports(2)
    service = NotifierService(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", heartbeat=0.1)
    yield from serve_in_thread(service)  # type: ignore[misc]


@pytest.fixture
def discovery(notifier: NotifierService) -> Iterator[DiscoveryService]:
    service = DiscoveryService(f"tcp://127.0.0.1:{free_ports(1)[0]}", notifier.endpoint, Timing(heartbeat=30.0))
    yield from serve_in_thread(service)  # type: ignore[misc]


@pytest.fixture
def rendezvous() -> Iterator[RendezvousService]:
    yield from serve_in_thread(RendezvousService(f"tcp://127.0.0.1:{free_ports(1)[0]}"))  # type: ignore[misc]
