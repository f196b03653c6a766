"""How an etcd member of the control plane is started: its command line, shared by the tests and `elasticctl local`.

The flags that matter, and why:
- `--heartbeat-interval 50 --election-timeout 500`: a dead leader is replaced
  within a second (etcd's defaults, 100 ms and 1 s, take twice as long); the
  members of one control plane sit in one data centre.
- `--experimental-watch-progress-notify-interval 1s`: a watch that asks for
  progress notifications hears from its member every second even when nothing
  changes, so a silent stream means a dead or cut-off member (EtcdClient.watch).
- `--max-request-bytes 8388608`: the registry saves a job's state and every
  part that changed in one txn, all or nothing. Its parts sit in at most 64
  compressed buckets (services/registry/etcd_store.py), within etcd's default
  of 128 operations per txn, but a reset of thousands of hosts rewrites every
  bucket: more than etcd's default 1.5 MiB per request leaves room for it.
- `--auto-compaction-mode periodic --auto-compaction-retention 10m`: etcd
  keeps every revision until it is compacted; the control plane rewrites its
  state at every decision, so without compaction a job of weeks fills etcd's
  backend until it refuses every write (`database space exceeded`). Ten
  minutes of history is far more than any watch of ours resumes from (seconds).
- `--quota-backend-bytes`: the backend's ceiling, stated rather than left at
  etcd's 2 GiB default, and sized below the member's volume (the chart's
  volume is at least twice its quota: compacted pages are reused, but the file
  only shrinks when defragmented).
- `--logger zap --log-level warn`: one JSON line per event worth reading.
- given the certificates (replication/etcd_tls.py): `https://` URLs, and a
  certificate the CA signed required of every client and peer.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from elastic_control_plane.replication.etcd_tls import EtcdTls

HEARTBEAT_MS = 50
ELECTION_TIMEOUT_MS = 500
MAX_REQUEST_BYTES = 8 * 1024 * 1024
COMPACTION_RETENTION = "10m"
QUOTA_BACKEND_BYTES = 1024 * 1024 * 1024


@dataclass(frozen=True)
class MemberSpec:
    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: Path
    tls: EtcdTls | None = None

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.peer_port}"


def initial_cluster(members: list[MemberSpec]) -> str:
    """etcd's --initial-cluster: `name=peer_url,...`."""
    return ",".join(f"{member.name}={member.peer_url}" for member in members)


def member_command(
    spec: MemberSpec,
    cluster: list[MemberSpec],
    *,
    state: str = "new",
    token: str = "elastic",
    quota_bytes: int = QUOTA_BACKEND_BYTES,
) -> list[str]:
    """The command line of member `spec` of `cluster` (every member, `spec` included). `state` is "new" for the
    members that found a cluster together, "existing" for one added to a running cluster (after `member_add`);
    a member whose data directory holds data ignores both and rejoins as what it was."""
    return [
        etcd_binary(),
        f"--name={spec.name}",
        f"--data-dir={spec.data_dir}",
        f"--listen-client-urls={spec.client_url}",
        f"--advertise-client-urls={spec.client_url}",
        f"--listen-peer-urls={spec.peer_url}",
        f"--initial-advertise-peer-urls={spec.peer_url}",
        f"--initial-cluster={initial_cluster(cluster)}",
        f"--initial-cluster-state={state}",
        f"--initial-cluster-token={token}",
        f"--heartbeat-interval={HEARTBEAT_MS}",
        f"--election-timeout={ELECTION_TIMEOUT_MS}",
        "--experimental-watch-progress-notify-interval=1s",
        f"--max-request-bytes={MAX_REQUEST_BYTES}",
        "--auto-compaction-mode=periodic",
        f"--auto-compaction-retention={COMPACTION_RETENTION}",
        f"--quota-backend-bytes={quota_bytes}",
        "--logger=zap",
        "--log-level=warn",
        *(spec.tls.member_flags() if spec.tls is not None else []),
    ]


def etcd_binary() -> str:
    """The path of the etcd server; FileNotFoundError saying how to install it when it is not on PATH."""
    found = shutil.which("etcd")
    if found is None:
        raise FileNotFoundError("etcd is not on PATH: apt-get install etcd-server etcd-client (etcd 3.4 or later)")
    return found
