"""`python -m services.registry`: run the registry."""

from services.cli import service_command
from services.registry.service import RegistryService

main = service_command(
    "registry",
    lambda bind, connect, timing, security, log: RegistryService(bind.registry, connect, timing, security=security, log=log),
)

if __name__ == "__main__":
    main()
