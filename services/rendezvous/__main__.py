"""`python -m elastic_control_plane.services.rendezvous`: run the rendezvous."""

from elastic_control_plane.services.cli import service_command
from elastic_control_plane.services.rendezvous.kv_log import KvLog
from elastic_control_plane.services.rendezvous.service import RendezvousService

main = service_command(
    "rendezvous",
    lambda bind, connect, timing, security, log, replica: RendezvousService(
        bind.rendezvous, kv_log=KvLog(replica) if replica is not None else None, security=security, log=log
    ),
)

if __name__ == "__main__":
    main()
