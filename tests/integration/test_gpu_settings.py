"""GPU settings through real agents, on any machine: slots default to the GPUs the agent sees, and the agent's
--share-gpus reaches its workers (a job's own environment cannot turn it on)."""

from __future__ import annotations

import sys
from pathlib import Path

from testing.harness import Cluster, wait_for

RECORD_ENV = """
import os, pathlib, sys, time
e = os.environ
out = pathlib.Path(sys.argv[1])
name = f"{e['ELASTIC_HOST']}-{e['ELASTIC_LOCAL_RANK']}"
(out / f".{name}").write_text(e["ELASTIC_GPU_SHARED"])
(out / f".{name}").rename(out / name)
time.sleep(120)
"""


def test_slots_default_to_the_gpus_the_agent_sees(cluster: Cluster) -> None:
    cluster.spawn(
        "agent-gpu-host",
        [sys.executable, "-m", "elastic_control_plane.agent.main", "--host", "gpu-host"],
        {**cluster.env, "CUDA_VISIBLE_DEVICES": "0,1,2"},
    )
    cluster.spawn(
        "agent-cpu-host",
        [sys.executable, "-m", "elastic_control_plane.agent.main", "--host", "cpu-host"],
        {**cluster.env, "CUDA_VISIBLE_DEVICES": ""},
    )
    available = wait_for(
        lambda: (hosts := dict(cluster.call("discovery", "hosts")["available"])) and len(hosts) == 2 and hosts,
        20,
        "both agents to register",
    )
    assert available == {"gpu-host": [0, 1, 2], "cpu-host": [0]}


def test_share_gpus_reaches_the_workers_of_that_agent_only(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_agent("host-1", 2, ["--share-gpus"])
    cluster.start_agent("host-2", 1)
    out = tmp_path / "env"
    out.mkdir()
    cluster.submit("--min-np", "3", "--env", "ELASTIC_GPU_SHARED=1", "--", sys.executable, "-c", RECORD_ENV, str(out))
    wait_for(lambda: len(list(out.glob("host-*"))) == 3, 30, "three workers to record their environment")
    assert {p.name: p.read_text() for p in out.glob("host-*")} == {"host-1-0": "1", "host-1-1": "1", "host-2-0": "0"}
