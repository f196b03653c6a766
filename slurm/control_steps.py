"""`elasticctl slurm --control-hosts N`: a replicated control plane inside the allocation, one control host on each of
its first N nodes, each in a Slurm step of its own.

The driver (slurm/batch.py, through `ControlSteps`) makes the etcd certificates for the nodes' addresses (in the
job's keys, STATE/JOB/keys/etcd/), then starts a step per control node (`srun -N1 -n1 -w NODE --overlap --no-kill
--kill-on-bad-exit=0 --job-name=elastic-control`: a lost node ends only its own step; the name keeps the agents'
drain off it) running `python -m elastic_control_plane.slurm.control_steps`: a control host
(elasticctl/control_host.py), one etcd member and one replica of each service, as `elasticctl local` runs them.

Ports: control hosts may share one address, and other jobs may hold ports there, so each step picks a free block on
its node (slurm/ports.py: the services' five ports, then its member's client and peer ports) among the blocks of its
index modulo N (two steps of one job never pick the same), and writes it to STATE/JOB/control-hosts/INDEX; once
every step has written its block, each starts its member and, etcd up, its replicas. A replica is named after its
node (ELASTIC_REPLICA) and given the endpoint lists with its own control host's first: of the endpoints on its
address it binds the first. STATE/JOB/control gets the address list (`A:P,B:P,C:P`) the agents and `elasticctl
run` are given.

Each run (a requeue's too) starts a fresh control plane: the claims, the members' data directories (STATE/JOB/etcd-I)
and the certificates are removed before it starts and when it ends; the job resumes from its checkpoint, as with one
control host. When a control node is lost, the other control hosts keep etcd's majority and take over its active
replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic_control_plane.bus.config import DEFAULT_PORTS, Endpoints, control_address
from elastic_control_plane.elasticctl.control import ControlPlane
from elastic_control_plane.elasticctl.control_host import etcd_members, replica_commands, store_url, wait_for_etcd
from elastic_control_plane.elasticctl.local_processes import SERVICES, Processes, StartFailed
from elastic_control_plane.replication.etcd_member import etcd_binary, member_command
from elastic_control_plane.replication.etcd_tls import ETCD_DIR, EtcdTls, make_etcd_certs
from elastic_control_plane.slurm import commands
from elastic_control_plane.slurm.allocation import allocation_groups
from elastic_control_plane.slurm.ports import PORT_STEP, free_port_block

MODULE = "elastic_control_plane.slurm.control_steps"
CLAIMS = "control-hosts"
START_TIMEOUT = 60.0  # seconds for every control host to pick its ports, and for etcd and the services to answer
STOP_GRACE = 10.0  # seconds the replicas and the member have after SIGTERM, before SIGKILL
SERVICE_PORTS = len(DEFAULT_PORTS)
BLOCK_WIDTH = SERVICE_PORTS + 2  # the services' ports, then the member's client and peer ports


def say(line: str) -> None:
    print(f"[elastic slurm] {line}", file=sys.stderr, flush=True)


def read_claims(claims: Path, count: int) -> list[tuple[str, int]] | None:
    """(address, first port) of every control host, in index order; None while one has not written its own."""
    hosts = []
    for index in range(count):
        try:
            claim = json.loads((claims / str(index)).read_text())
        except (OSError, ValueError):
            return None
        hosts.append((str(claim["address"]), int(claim["base"])))
    return hosts


class ControlSteps:
    """The driver's side: the control hosts' steps started, waited for, and what they leave removed."""

    def __init__(self, job_dir: Path, keys: Path, count: int, processes: Processes, env: dict[str, str]) -> None:
        self.job_dir, self.keys, self.count = job_dir, keys, count
        self.processes, self.env = processes, env
        self.claims = job_dir / CLAIMS

    def start(self) -> str:
        """Start the control hosts on the allocation's first `count` nodes; their address list, written to
        STATE/JOB/control, once every service answers. FileNotFoundError when etcd is not installed."""
        etcd_binary()
        nodes = allocation_groups(os.environ)[: self.count]
        if len(nodes) < self.count:
            raise StartFailed(f"--control-hosts {self.count}: the allocation has {len(nodes)} node(s)")
        addresses = [commands.node_address(node) for _, node in nodes]
        self.remove()
        self.claims.mkdir(mode=0o700)
        (self.job_dir / "logs").mkdir(exist_ok=True)
        make_etcd_certs(self.keys, ["localhost", *addresses])
        for index, ((group, node), address) in enumerate(zip(nodes, addresses, strict=True)):
            het = [f"--het-group={group}"] if group is not None else []
            step = ["srun", *het, "-N1", "-n1", "-w", node, "--overlap", "--no-kill", "--kill-on-bad-exit=0"]
            own = [sys.executable, "-m", MODULE, "--job-dir", str(self.job_dir), "--keys", str(self.keys)]
            own += ["--index", str(index), "--count", str(self.count), "--address", address, "--node", node]
            argv = [*step, f"--job-name={commands.CONTROL_STEP}", *own]
            self.processes.start(f"control {node}", argv, self.env, None)
        steps = [f"control {node}" for _, node in nodes]
        hosts = self.processes.wait_until(
            lambda: read_claims(self.claims, self.count), START_TIMEOUT, "every control host's ports", steps
        )
        plane = ControlPlane(Endpoints.on_hosts(hosts), self.keys, timeout=0.5)
        try:
            for service in SERVICES:
                self.processes.wait_until(
                    lambda s=service: plane.call(s, "ping"), START_TIMEOUT, f"{service} to answer", steps
                )
        finally:
            plane.close()
        control = ",".join(control_address(address, base) for address, base in hosts)
        (self.job_dir / "control").write_text(control + "\n")
        say(f"control hosts on {', '.join(node for _, node in nodes)}")
        return control

    def remove(self) -> None:
        """The claims, the members' data directories and the certificates of this or an earlier run."""
        shutil.rmtree(self.claims, ignore_errors=True)
        shutil.rmtree(self.keys / ETCD_DIR, ignore_errors=True)
        for data_dir in self.job_dir.glob("etcd-*"):
            shutil.rmtree(data_dir, ignore_errors=True)


class Stopped(Exception):
    """SIGTERM: the step is ending (the job is over, or its node is being lost)."""


def _stop(*_: Any) -> None:
    raise Stopped


def own_block(address: str, index: int, count: int) -> int:
    """The first free block of BLOCK_WIDTH ports on `address` among those of `index` modulo `count`."""
    base = 0
    while True:
        base = free_port_block(address, after=base, width=BLOCK_WIDTH)
        if (base - DEFAULT_PORTS["discovery"]) // PORT_STEP % count == index:
            return base


def run_control_host(args: argparse.Namespace) -> int:
    """Pick this host's ports, wait for the others', then run the member and the replicas until SIGTERM."""
    claims = args.job_dir / CLAIMS
    base = own_block(args.address, args.index, args.count)
    written = claims / f".{args.index}.new"
    written.write_text(json.dumps({"address": args.address, "base": base}))
    os.replace(written, claims / str(args.index))
    deadline = time.monotonic() + START_TIMEOUT
    while (hosts := read_claims(claims, args.count)) is None:
        if time.monotonic() > deadline:
            say(f"control host {args.node}: the other control hosts did not pick their ports in {START_TIMEOUT:g} s")
            return 1
        time.sleep(0.1)
    tls = EtcdTls(args.keys / ETCD_DIR)
    members = etcd_members([(a, b + SERVICE_PORTS, b + SERVICE_PORTS + 1) for a, b in hosts], args.job_dir, tls)
    member = members[args.index]
    shutil.rmtree(member.data_dir, ignore_errors=True)
    logs = args.job_dir / "logs"
    run = os.environ.get("SLURM_RESTART_COUNT") or "0"
    state_dir = Path(tempfile.mkdtemp(prefix="elastic-slurm-state-"))
    processes = Processes()
    try:
        etcd_log = logs / f"etcd@{args.node}-{run}.log"
        processes.start(f"etcd@{args.node}", member_command(member, members), dict(os.environ), etcd_log)
        wait_for_etcd(members, lambda probe, what: processes.wait_until(probe, START_TIMEOUT, what, processes.running))
        own_first = hosts[args.index :] + hosts[: args.index]  # a replica binds the first endpoint on its address
        env = {
            **os.environ,
            **Endpoints.on_hosts(own_first).as_env(),
            "ELASTIC_STORE": store_url(members),
            "ELASTIC_REPLICA": args.node,
            "ELASTIC_KEYS": str(args.keys),
            "ELASTIC_STATE_DIR": str(state_dir),
        }
        for name, argv in replica_commands(args.address, args.node):
            processes.start(name, argv, env, logs / f"{name}-{run}.log")
        while any(process.poll() is None for process in processes.running.values()):
            time.sleep(0.5)
        say(f"control host {args.node}: its etcd member and replicas exited")
        return 1
    except Stopped:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        processes.stop_all(grace=STOP_GRACE)
        shutil.rmtree(member.data_dir, ignore_errors=True)
        shutil.rmtree(state_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--job-dir", type=Path, required=True)
    parser.add_argument("--keys", type=Path, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--node", required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    try:
        return run_control_host(args)
    except Stopped:  # before its processes started: nothing to stop
        return 0
    except (StartFailed, OSError) as exc:
        say(f"control host {args.node} cannot start: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
