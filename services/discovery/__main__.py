"""`python -m services.discovery`: run discovery."""

from services.cli import service_command
from services.discovery.service import DiscoveryService

main = service_command(
    "discovery",
    lambda bind, connect, timing, security, log: DiscoveryService(
        bind.discovery, connect.notifier, timing, security=security, log=log
    ),
)

if __name__ == "__main__":
    main()
