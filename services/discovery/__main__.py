"""`python -m services.discovery`: run discovery."""

from services.cli import service_command
from services.discovery.marks_log import MarksLog
from services.discovery.service import DiscoveryService

main = service_command(
    "discovery",
    lambda bind, connect, timing, security, log, replica: DiscoveryService(
        bind.discovery,
        connect.notifier,
        timing,
        marks_log=MarksLog(replica) if replica is not None else None,
        security=security,
        log=log,
    ),
)

if __name__ == "__main__":
    main()
