"""`python -m elastic_control_plane.bus.ping ENDPOINT...`: exit 0 if a service answers `ping` at each endpoint (an
endpoint list, comma-separated, counts as one: a replicated service), printing each service's name (container
healthchecks, `helm test`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from elastic_control_plane.bus.client import Client, ServiceError, Unreachable, incarnation_id
from elastic_control_plane.bus.sockets import Security


def ping(endpoint: str, security: Security) -> bool:
    client = Client(endpoint, incarnation_id("ping"), security=security, timeout=1.0, deadline=1.0)
    try:
        print(client.request("ping").body["service"])
        return True
    except (Unreachable, ServiceError) as exc:
        print(f"ping: {exc}", file=sys.stderr)
        return False
    finally:
        client.close()


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m elastic_control_plane.bus.ping ENDPOINT [ENDPOINT...]", file=sys.stderr)
        return 2
    keys = os.environ.get("ELASTIC_KEYS")
    security = Security(keys_dir=Path(keys) if keys else None)
    answered = [ping(endpoint, security) for endpoint in argv]
    return 0 if all(answered) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
