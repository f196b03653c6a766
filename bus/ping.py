"""`python -m elastic_control_plane.bus.ping ENDPOINT`: exit 0 if a service answers `ping` there (container
healthchecks)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from elastic_control_plane.bus.client import Client, ServiceError, Unreachable, incarnation_id
from elastic_control_plane.bus.sockets import Security


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m elastic_control_plane.bus.ping ENDPOINT", file=sys.stderr)
        return 2
    keys = os.environ.get("ELASTIC_KEYS")
    client = Client(
        argv[0],
        incarnation_id("ping"),
        security=Security(keys_dir=Path(keys) if keys else None),
        timeout=1.0,
        deadline=1.0,
    )
    try:
        print(client.request("ping").body["service"])
        return 0
    except (Unreachable, ServiceError) as exc:
        print(f"ping: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
