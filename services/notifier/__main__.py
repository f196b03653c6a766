"""`python -m elastic_control_plane.services.notifier`: run the notifier."""

from elastic_control_plane.services.cli import service_command
from elastic_control_plane.services.notifier.event_log import EventLog
from elastic_control_plane.services.notifier.service import NotifierService

main = service_command(
    "notifier",
    lambda bind, connect, timing, security, log, replica: NotifierService(
        bind.notifier,
        bind.events,
        heartbeat=timing.heartbeat,
        security=security,
        log=log,
        event_log=EventLog(replica) if replica is not None else None,
    ),
)

if __name__ == "__main__":
    main()
