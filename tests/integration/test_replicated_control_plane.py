"""A control plane that survives losing its host (issue 33): a real 3-member etcd on loopback, one replica of each
service on each of three control hosts (127.0.0.1-3), agents and clients given all three.

A whole control host lost mid-job (every replica on it SIGKILLed, its etcd member killed and its data directory
deleted), early and late in the job, and replaced; each service's active replica killed alone; etcd losing its
quorum and getting it back: in every case training goes on, no reset is spent, and the job ends with every commit
(none lost, none repeated). A replica paused past its lease steps down without writing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_control_plane.replication.election import ACTIVE, ElectionTiming, Leadership, LostRole
from elastic_control_plane.replication.etcd import EtcdClient, put_op
from elastic_control_plane.replication.replica import Replica
from elastic_control_plane.services.notifier.event_log import EventLog
from elastic_control_plane.services.rendezvous.kv_log import KvLog
from testing.control_hosts import PREFIX, ReplicatedCluster, replica_name
from testing.etcd_cluster import EtcdCluster
from testing.harness import SERVICES, wait_for
from testing.recording_log import RecordingLog
from tests.integration.test_control_plane_restarts import kill_a_worker_and_see_it_recovered, start_job
from tests.integration.test_snapshots import assert_finished_exactly, committed

BATCHES = 1500  # 30 s at least: room for two host losses and their replacements, each with a worker killed after it
TAKEOVER_DEADLINE = 20  # generous for a loaded 2-core machine; bench/control_plane_ha.py measures the real time


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    members = EtcdCluster(tmp_path / "etcd")
    try:
        members.start()
        yield members
    finally:
        members.stop()


@pytest.fixture
def replicated(request: pytest.FixtureRequest, tmp_path: Path, etcd: EtcdCluster) -> Iterator[ReplicatedCluster]:
    cluster = ReplicatedCluster(tmp_path / "cluster", etcd)
    try:
        cluster.start_services()
        yield cluster
    finally:
        cluster.close()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(cluster.dump_logs())
            print(etcd.dump_logs())


def training(cluster: ReplicatedCluster, log_dir: Path) -> subprocess.Popen[bytes]:
    """The job of test_control_plane_restarts.py (2 hosts x 1 slot, a commit per batch), once it trains."""
    run = start_job(cluster, log_dir, BATCHES)
    wait_for(lambda: committed(log_dir) >= 20 and cluster.job()["state"] == "running", 60, "the job to train")
    return run


def every_service_active_elsewhere(cluster: ReplicatedCluster, lost: str) -> dict[str, str]:
    def answered() -> dict[str, str] | None:
        actives = cluster.actives()
        if any(host in (None, lost) for host in actives.values()):
            return None
        for service in SERVICES:
            cluster.call(service, "ping", timeout=0.5)
        return actives  # type: ignore[return-value]

    return wait_for(answered, TAKEOVER_DEADLINE, f"every service active on a host other than {lost}")


def busiest_control_host(cluster: ReplicatedCluster) -> str:
    """The control host with the most active replicas (ties: the one with etcd's leader)."""
    counts = Counter(host for host in cluster.actives().values() if host is not None)
    leader = cluster.control_hosts[cluster.etcd.leader_index()]
    return max(cluster.control_hosts, key=lambda host: (counts[host], host == leader))


def lose_and_replace_a_control_host(cluster: ReplicatedCluster, log_dir: Path) -> None:
    before = cluster.job()
    lost = busiest_control_host(cluster)
    cluster.kill_control_host(lost)
    at_loss = committed(log_dir)
    every_service_active_elsewhere(cluster, lost)
    wait_for(lambda: committed(log_dir) >= at_loss + 10, 30, f"training to go on without {lost}")
    job = cluster.job()
    assert (job["job"], job["state"], job["round"], job["resets"]) == (
        before["job"],
        "running",
        before["round"],
        before["resets"],
    ), f"losing {lost} cost no reset: {before} -> {job}"
    cluster.replace_control_host(lost)
    wait_for(
        lambda: all("standby" in cluster.output(replica_name(s, lost)) for s in SERVICES),
        TAKEOVER_DEADLINE,
        f"the replicas on the new {lost} to stand by",
    )


def test_losing_a_whole_control_host_early_and_late_costs_no_reset_and_no_commit(
    replicated: ReplicatedCluster, tmp_path: Path
) -> None:
    log_dir = tmp_path / "train"
    run = training(replicated, log_dir)
    lose_and_replace_a_control_host(replicated, log_dir)
    kill_a_worker_and_see_it_recovered(replicated, log_dir)
    lose_and_replace_a_control_host(replicated, log_dir)
    kill_a_worker_and_see_it_recovered(replicated, log_dir)
    assert replicated.wait_job_end(run, 240) == 0, replicated.output("elasticctl-run")
    assert_finished_exactly(log_dir, batches=BATCHES)
    assert replicated.job()["state"] == "succeeded"


def test_each_service_fails_over_alone_without_a_reset(replicated: ReplicatedCluster, tmp_path: Path) -> None:
    log_dir = tmp_path / "train"
    run = training(replicated, log_dir)
    for service in SERVICES:
        before = replicated.job()
        holder = replicated.active(service)
        assert holder is not None
        replicated.processes[replica_name(service, holder)].send_signal(signal.SIGKILL)
        wait_for(
            lambda s=service, h=holder: replicated.active(s) not in (None, h) and replicated.call(s, "ping"),
            TAKEOVER_DEADLINE,
            f"another {service} replica to take over from {holder}",
        )
        at_takeover = committed(log_dir)
        wait_for(lambda: committed(log_dir) >= at_takeover + 10, 30, f"training after the {service} failover")
        job = replicated.job()
        assert (job["round"], job["resets"]) == (before["round"], before["resets"]), (service, before, job)
        replicated.start_replicas(holder, (service,))  # back as a standby
    kill_a_worker_and_see_it_recovered(replicated, log_dir)
    assert replicated.wait_job_end(run, 240) == 0, replicated.output("elasticctl-run")
    assert_finished_exactly(log_dir, batches=BATCHES)


def test_a_registry_paused_past_its_lease_steps_down_and_writes_nothing(
    replicated: ReplicatedCluster, tmp_path: Path
) -> None:
    log_dir = tmp_path / "train"
    training(replicated, log_dir)
    holder = replicated.active("registry")
    assert holder is not None
    paused = replicated.processes[replica_name("registry", holder)]
    paused.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: replicated.active("registry") not in (None, holder), TAKEOVER_DEADLINE, "a new registry")
        took_over = wait_for(replicated.job, TAKEOVER_DEADLINE, "the new registry to answer")
    finally:
        paused.send_signal(signal.SIGCONT)
    wait_for(lambda: "stepped_down" in replicated.output(replica_name("registry", holder)), 20, "the step-down")
    log = replicated.output(replica_name("registry", holder))
    resumed = log[log.rindex('"active"') :]
    assert "refused" not in resumed.split("stepped_down")[0], resumed
    wait_for(
        lambda: "standby" in replicated.output(replica_name("registry", holder)).split("stepped_down")[-1],
        20,
        "the paused replica back as a standby",
    )
    job = replicated.job()
    assert (job["job"], job["round"], job["resets"]) == (took_over["job"], took_over["round"], took_over["resets"])
    kill_a_worker_and_see_it_recovered(replicated, log_dir)


def test_a_write_fenced_by_a_lost_role_never_reaches_etcd(etcd: EtcdCluster) -> None:
    """The fence itself: a replica whose lease expired (it stopped renewing, as a paused one does) is refused by etcd
    even when its own clock has not noticed, and gives the role up."""
    client = EtcdClient(etcd.client_endpoints)
    try:
        first = Leadership(client, "fence-test", "registry", "a", "tcp://a:1", timing=ElectionTiming(1))
        never = threading.Event()
        assert first.register(never) and first.campaign(never)
        first._stop.set()  # its keepalives stop, as a paused replica's do, while it believes it is active
        second = Leadership(client, "fence-test", "registry", "b", "tcp://b:1", timing=ElectionTiming(1))
        assert second.register(never) and second.campaign(never)
        first._valid_until = time.monotonic() + 60  # its clock, fooled: only the fence stands between it and etcd
        with pytest.raises(LostRole):
            first.write([put_op(b"fence-test/registry/state", b"from the ex-active")])
        assert not first.held()
        assert client.get(b"fence-test/registry/state") is None
        second.write([put_op(b"fence-test/registry/state", b"from the active")])
        assert client.get(b"fence-test/registry/state").value == b"from the active"  # type: ignore[union-attr]
        second.end("the test ends", revoke=True)
    finally:
        client.close()


def watchers(etcd: EtcdCluster) -> int:
    """The watches etcd's members serve now (their metrics)."""
    total = 0
    for endpoint in etcd.client_endpoints:
        text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=2).read().decode()
        total += sum(
            int(float(line.split()[1]))
            for line in text.splitlines()
            if line.startswith("etcd_debugging_mvcc_watcher_total ")
        )
    return total


def test_a_standby_takes_over_when_the_leader_keys_own_history_was_compacted(etcd: EtcdCluster) -> None:
    """etcd compacts its history (every 10 minutes on the members we start): a standby that waits for the role
    watches from the revision it read the leader key at, so the key's own revision, compacted long ago, costs it
    nothing: no false "etcd unreachable", and it takes over as soon as the leader resigns."""
    client = EtcdClient(etcd.client_endpoints)
    try:
        first = Leadership(client, "compact-test", "registry", "a", "tcp://a:1", timing=ElectionTiming(1))
        never = threading.Event()
        assert first.register(never) and first.campaign(never)
        for number in range(20):
            latest = client.put(b"compact-test/registry/state", str(number).encode())
        client.compact(latest)
        said = RecordingLog()
        second = Leadership(
            client.sibling(),
            "compact-test",
            "registry",
            "b",
            "tcp://b:1",
            timing=ElectionTiming(1),
            log=said,  # type: ignore[arg-type]
        )
        assert second.register(never)
        won = threading.Thread(target=second.campaign, args=(never,), daemon=True)
        watching_before = watchers(etcd)
        won.start()
        wait_for(lambda: watchers(etcd) > watching_before, 10, "the standby's watch of the leader key")
        first.end("handing over", revoke=True)
        won.join(10)
        assert second.state == ACTIVE and "etcd_unreachable" not in said.names(), said.names()
        second.end("the test ends", revoke=True)
    finally:
        client.close()


def test_an_event_that_evicts_hundreds_and_a_drop_of_many_rounds_stay_within_etcds_txn_limit(
    etcd: EtcdCluster,
) -> None:
    """The notifier's event log lets go of the oldest events with one range delete, however many (a large `round`
    event evicts hundreds), and the rendezvous drops the keys of the rounds that are over one range delete per
    round: etcd's limit of 128 operations per txn is never reached."""
    client = EtcdClient(etcd.client_endpoints)
    try:
        role = Leadership(client, "txn-test", "notifier", "a", "tcp://a:1", timing=ElectionTiming(1))
        never = threading.Event()
        assert role.register(never) and role.campaign(never)
        replica = Replica(client, "txn-test", role)
        events = EventLog(replica)
        events.start("i1")
        for seq in range(1, 301):
            events.append("i1", "tick", {"seq": seq}, [])
        events.append("i1", "round", {"seq": 301}, list(range(1, 251)))
        incarnation, latest, kept = events.load()
        assert (incarnation, latest) == ("i1", 301)
        assert [body["seq"] for _, body in kept] == list(range(251, 302))
        store = KvLog(replica)
        for number in range(200):
            store.set(f"round/{number}/store_addr", b"host:1234")
        store.drop_prefixes([f"round/{number}/" for number in range(198)])
        assert sorted(store.load()) == ["round/198/store_addr", "round/199/store_addr"]
        role.end("the test ends", revoke=True)
    finally:
        client.close()


def test_a_corrupt_record_is_one_line_per_replica_that_then_waits_and_serves_once_it_is_repaired(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    """A bucket of the registry's saved parts that is not what the registry writes: each replica elected says so in
    one line naming the key and stands by, with no restart loop; once an operator deletes the key, a replica is
    elected again and serves."""
    client = EtcdClient(etcd.client_endpoints)
    client.put(b"elastic/registry/parts/07", b"not zlib at all")
    cluster = ReplicatedCluster(tmp_path / "cluster", etcd)
    try:
        for host in cluster.control_hosts[:2]:
            cluster.start_replicas(host, ("registry",))
        names = [replica_name("registry", host) for host in cluster.control_hosts[:2]]

        def corrupt_lines() -> list[str]:
            return [line for name in names for line in cluster.output(name).splitlines() if "corrupt_record" in line]

        wait_for(lambda: len(corrupt_lines()) == 2, 30, "each replica to name the corrupt key")
        assert all("elastic/registry/parts/07" in line and "not zlib" in line for line in corrupt_lines())
        assert not any(
            "start_failed" in cluster.output(name) or "stepped_down" in cluster.output(name) for name in names
        )
        assert [cluster.processes[name].poll() for name in names] == [None, None], "both wait, alive"
        shown = subprocess.run(
            [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "status"],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode != 0, "the registry does not answer"
        assert "registry cannot start: its record elastic/registry/parts/07 cannot be read (not zlib" in shown.stdout, (
            shown.stdout + shown.stderr
        )
        client.delete(b"elastic/registry/parts/07")
        wait_for(lambda: cluster.call("registry", "ping", timeout=0.5), 30, "a registry that serves")
        wait_for(lambda: client.get(b"elastic/corrupt/registry") is None, 10, "the mark gone with the corruption")
        assert len(corrupt_lines()) == 2, "said once each"
    finally:
        cluster.close()
        client.close()


def test_quorum_lost_stops_decisions_training_goes_on_and_everything_resumes_when_it_returns(
    replicated: ReplicatedCluster, tmp_path: Path
) -> None:
    log_dir = tmp_path / "train"
    run = training(replicated, log_dir)
    before, actives = replicated.job(), replicated.actives()
    leader = replicated.etcd.leader_index()
    down = [leader, (leader + 1) % 3]
    for index in down:
        replicated.etcd.kill(index)
    at_loss = committed(log_dir)
    wait_for(
        lambda: all("stepped_down" in replicated.output(replica_name(s, h)) for s, h in actives.items()),  # type: ignore[arg-type]
        TAKEOVER_DEADLINE,
        "every active replica to stop deciding",
    )
    wait_for(lambda: committed(log_dir) >= at_loss + 50, 60, "training to go on without quorum")
    for service, host in actives.items():
        log = replicated.output(replica_name(service, host))  # type: ignore[arg-type]
        assert log.count("etcd_unreachable") <= 1, f"{service}@{host} said etcd was out of reach once: {log}"
    for index in down:
        replicated.etcd.restart(index)
    every_service_active_elsewhere(replicated, lost="none")
    job = replicated.job()
    assert (job["job"], job["round"], job["resets"]) == (before["job"], before["round"], before["resets"])
    kill_a_worker_and_see_it_recovered(replicated, log_dir)
    assert replicated.wait_job_end(run, 240) == 0, replicated.output("elasticctl-run")
    assert_finished_exactly(log_dir, batches=BATCHES)


def run_service(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.services.rendezvous", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "store, problem",
    [
        ("etcd://", "no endpoint"),
        ("etcd://127.0.0.1", "port"),
        ("etcd://127.0.0.1:99999", "port"),
        ("zookeeper://127.0.0.1:2181", "want sqlite or etcd://"),
    ],
)
def test_a_malformed_store_is_one_line_and_exit_2(store: str, problem: str) -> None:
    result = run_service("--store", store, "--bind", "127.0.0.2")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "--store" in lines[0], result.stderr


def test_an_unreachable_store_and_a_newer_schema_are_one_line_and_exit_2(etcd: EtcdCluster) -> None:
    result = run_service("--bind", "127.0.0.2", env={"ELASTIC_STORE": "etcd://127.0.0.1:1/unreachable"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "cannot be used" in lines[0], result.stderr
    client = EtcdClient(etcd.client_endpoints)
    try:
        client.put(f"{PREFIX}-newer/schema".encode(), b"99")
    finally:
        client.close()
    result = run_service("--bind", "127.0.0.2", env={"ELASTIC_STORE": f"{etcd.store_url}/{PREFIX}-newer"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "newer version" in lines[0], result.stderr


def test_a_replica_elected_where_its_address_is_taken_gives_the_role_to_another(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    cluster = ReplicatedCluster(tmp_path / "cluster", etcd)
    port = int(cluster.endpoints.registry.rpartition(":")[2])
    squatter = socket.socket()
    try:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        cluster.start_replicas("127.0.0.1", ("registry",))
        wait_for(lambda: "start_failed" in cluster.output(replica_name("registry", "127.0.0.1")), 30, "the failure")
        cluster.start_replicas("127.0.0.2", ("registry",))
        wait_for(lambda: cluster.active("registry") == "127.0.0.2", 30, "the replica on 127.0.0.2 to take the role")
        assert cluster.call("registry", "ping", timeout=5)["service"] == "registry"
        assert cluster.processes[replica_name("registry", "127.0.0.1")].poll() is None, "it stands by, not exits"
    finally:
        squatter.close()
        cluster.close()
