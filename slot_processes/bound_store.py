"""A TCPStore server that listens on the address it advertises, and nowhere else.

torch's TCPStore server binds every interface (`::`, both IP versions) whatever host it is given, and asks no one who
connects: a round's store was open to any machine that reaches the host, and whoever wrote to it could steer how the
round's process groups form. Here the socket is bound first, to the advertised address at a free port, and handed
over to torch (`master_listen_fd`: its server takes the descriptor and closes it with the store).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist


def serve_store(
    address: str, timeout: timedelta, world_size: int | None = None, wait_for_workers: bool = False
) -> dist.TCPStore:
    """A TCPStore server on `address` (a name or an IP address) at a free port; its `port` says which."""
    family, kind, proto, _, where = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()
    try:
        return dist.TCPStore(
            address,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=wait_for_workers,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise
