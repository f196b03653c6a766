"""`python -m elastic_control_plane.services.registry`: run the registry."""

from elastic_control_plane.services.cli import service_command
from elastic_control_plane.services.registry.etcd_store import EtcdJobStore
from elastic_control_plane.services.registry.service import RegistryService
from elastic_control_plane.services.registry.store import SqliteJobStore

main = service_command(
    "registry",
    lambda bind, connect, timing, security, log, replica, state_dir: RegistryService(
        bind.registry,
        connect,
        timing,
        EtcdJobStore(replica) if replica is not None else SqliteJobStore(state_dir),
        security=security,
        log=log,
    ),
    keeps_state=True,
)

if __name__ == "__main__":
    main()
