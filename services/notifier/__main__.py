"""`python -m services.notifier`: run the notifier."""

from services.cli import service_command
from services.notifier.service import NotifierService

main = service_command(
    "notifier",
    lambda bind, connect, timing, security, log: NotifierService(
        bind.notifier, bind.events, heartbeat=timing.heartbeat, security=security, log=log
    ),
)

if __name__ == "__main__":
    main()
