"""`elasticctl local --control-hosts 3`: three control hosts on 127.0.0.1-3 (an etcd member and a replica of each
service each), as a user tries the replicated control plane on one machine. `elasticctl status` shows every control
host; its etcd members answer only the run's own certificate (a plain client gets nothing); the control host with the
most active replicas is lost outright mid-job (its replicas and its etcd member SIGKILLed), nothing restarts it, and
the job finishes with every commit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastic_control_plane.elasticctl.local import ETCD_CLIENT_PORT, SERVICES, control_addresses
from elastic_control_plane.replication.etcd import EtcdClient, EtcdError
from testing.harness import REPO, Cluster, processes_with_env, wait_for
from tests.integration.test_snapshots import assert_finished_exactly, committed

BATCHES = 600
CONTROL = ",".join(control_addresses(3))
STORE = "etcd://" + ",".join(f"{host}:{ETCD_CLIENT_PORT}" for host in control_addresses(3))


def status(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_control_plane.elasticctl.main",
            "status",
            "--control",
            CONTROL,
            "--store",
            STORE,
            *args,
        ],
        env=cluster.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


def control_hosts(cluster: Cluster) -> list[dict[str, Any]] | None:
    result = status(cluster, "--json")
    return json.loads(result.stdout)["control_hosts"] if result.returncode == 0 else None


def actives(rows: list[dict[str, Any]]) -> dict[str, str]:
    return {s: row["host"] for row in rows for s, r in row["replicas"].items() if r["role"] == "active"}


def etcd_member_pid(host: str) -> int:
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            entry.name.isdigit()
            and argv
            and argv[0].endswith(b"etcd")
            and f"--name=control-{host[-1]}".encode() in argv
        ):
            return int(entry.name)
    raise AssertionError(f"no etcd member running for {host}")


def test_three_control_hosts_on_one_machine_show_in_status_and_a_lost_one_costs_the_job_nothing(
    tmp_path: Path,
) -> None:
    cluster = Cluster(tmp_path)
    log_dir = tmp_path / "train"
    job = [sys.executable, "tests/workers/counter.py", "--batches", str(BATCHES), "--step-delay", "0.02"]
    env = {k: v for k, v in cluster.env.items() if not k.endswith("_ENDPOINT")}  # local's own endpoints
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elastic_control_plane.elasticctl.main",
            "local",
            "--hosts",
            "2",
            "--slots",
            "1",
            "--control-hosts",
            "3",
        ]
        + ["--min-np", "2", "--", *job, "--log-dir", str(log_dir)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    cluster.env = {**env, "ELASTIC_CONTROL": CONTROL}
    try:
        wait_for(lambda: committed(log_dir) >= 20, 120, "the job to train")
        rows = wait_for(lambda: (r := control_hosts(cluster)) and len(actives(r)) == 4 and r, 30, "4 active services")
        assert [row["host"] for row in rows] == control_addresses(3)
        assert all(row["etcd"]["healthy"] for row in rows) and sum(row["etcd"]["leader"] for row in rows) == 1
        assert all(set(row["replicas"]) == set(SERVICES) for row in rows), rows
        text = status(cluster).stdout
        assert "control hosts:" in text and text.count("etcd leader") == 1, text
        assert all(row["etcd"]["db_size"] >= row["etcd"]["db_size_in_use"] > 0 for row in rows), rows
        assert text.count(" in use)") == 3, text
        stranger = EtcdClient(STORE.removeprefix("etcd://").split(","), deadline=2.0)
        try:  # the members require the run's own certificate: nobody else on the machine reads or writes the job
            with pytest.raises(EtcdError):
                stranger.get(b"elastic/registry/state")
        finally:
            stranger.close()

        counts = {row["host"]: sum(r["role"] == "active" for r in row["replicas"].values()) for row in rows}
        lost = max(counts, key=lambda host: counts[host])
        lost_row = next(row for row in rows if row["host"] == lost)
        for replica in lost_row["replicas"].values():
            os.kill(replica["pid"], signal.SIGKILL)
        os.kill(etcd_member_pid(lost), signal.SIGKILL)
        at_loss = committed(log_dir)
        wait_for(
            lambda: (r := control_hosts(cluster)) and len(a := actives(r)) == 4 and lost not in a.values(),
            60,
            f"every service active on a host other than {lost}",
        )
        rows = control_hosts(cluster) or []
        assert not next(row for row in rows if row["host"] == lost)["etcd"]["healthy"]
        wait_for(lambda: committed(log_dir) >= at_loss + 20, 60, "training after the loss")
        output, _ = run.communicate(timeout=180)
        assert run.returncode == 0, output.decode(errors="replace")[-3000:]
        assert_finished_exactly(log_dir, batches=BATCHES)
        assert b"starting it again" not in output  # the replicas are the redundancy: nothing restarted
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert processes_with_env(str(tmp_path)) == [], "elasticctl local left processes behind"
