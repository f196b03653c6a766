"""Which TCP ports a set of processes listens on, and on which address: read from /proc (net/tcp, net/tcp6 and each
process's open descriptors), for tests that check nothing of a job listens beyond loopback."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

LISTEN = "0A"  # the kernel's TCP_LISTEN, as /proc/net/tcp writes a socket's state


def descendants(root: int) -> list[int]:
    """`root` and every process below it (workers may lead sessions of their own: the tree, not the session)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])  # after the command: state, ppid
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    except OSError:
        pass
    return inodes


def _address(hex_address: str) -> str:
    """/proc/net/tcp's ADDRESS:PORT (hex, the address in the host's byte order per 32-bit word) as `address:port`."""
    address, port = hex_address.split(":")
    raw = bytes.fromhex(address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{ipaddress.ip_address(words)}:{int(port, 16)}"


def listening(pids: list[int]) -> list[str]:
    """Every `address:port` one of `pids` listens on over TCP (IPv4 and IPv6)."""
    inodes = set().union(*(_socket_inodes(pid) for pid in pids)) if pids else set()
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                found.append(_address(fields[1]))
    return found


def beyond_loopback(addresses: list[str]) -> list[str]:
    """Those of `addresses` another machine could reach: not 127.0.0.0/8, ::1 or an IPv4-mapped loopback."""
    outside = []
    for address in addresses:
        ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        if not (ip.is_loopback or (mapped is not None and mapped.is_loopback)):
            outside.append(address)
    return outside
