"""`python -m services.registry`: run the registry."""

from services.cli import service_command
from services.registry.service import RegistryService
from services.registry.store import SqliteJobStore

main = service_command(
    "registry",
    lambda bind, connect, timing, security, log, state_dir: RegistryService(
        bind.registry, connect, timing, SqliteJobStore(state_dir), security=security, log=log
    ),
    keeps_state=True,
)

if __name__ == "__main__":
    main()
