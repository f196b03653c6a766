"""`python -m services.rendezvous`: run the rendezvous."""

from services.cli import service_command
from services.rendezvous.service import RendezvousService

main = service_command(
    "rendezvous",
    lambda bind, connect, timing, security, log: RendezvousService(bind.rendezvous, security=security, log=log),
)

if __name__ == "__main__":
    main()
