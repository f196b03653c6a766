"""The control plane's ports on a node that other jobs' control planes may share (every node of a job may even have
one address): blocks of ten, from DEFAULT_PORTS' first, of which a control plane takes the first five (its services)
and a replicated one's control host two more (its etcd member's client and peer ports)."""

from __future__ import annotations

import socket

from elastic_control_plane.bus.config import DEFAULT_PORTS
from elastic_control_plane.elasticctl.local_processes import StartFailed

PORT_STEP, PORT_BLOCKS = 10, 100


def free_port_block(address: str, after: int = 0, width: int = len(DEFAULT_PORTS)) -> int:
    """The first port from DEFAULT_PORTS' first, in steps of ten and past `after`, that starts `width` ports free on
    `address` (the control plane's five: its first is discovery's)."""
    first = DEFAULT_PORTS["discovery"]
    for base in range(max(first, after + PORT_STEP), first + PORT_STEP * PORT_BLOCKS, PORT_STEP):
        if all(port_free(address, base + offset) for offset in range(width)):
            return base
    raise StartFailed(f"no {width} free ports on {address} from {first} to {first + PORT_STEP * PORT_BLOCKS - 1}")


def port_free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds: a port in TIME_WAIT is free
        try:
            probe.bind((address.strip("[]"), port))
        except OSError:
            return False
    return True
