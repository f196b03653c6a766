"""A user's files never shadow ours, nor ours theirs (issue 44): a training directory that holds `agent.py`,
`bus.py`, `snapshot.py`, `services.py`, `testing.py` and `replication.py`, which its script imports, runs under
`elasticctl local` as installed (the virtualenv's `elasticctl`, no PYTHONPATH), started from that directory and from
elsewhere outside the repository, with workers forked and spawned: every run trains, each of those names is the
user's module in every worker, the workers hold nothing of the agent or the services, and the agents and services
start as if the files were not there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_control_plane.bus.lifetime import die_with_parent
from testing.harness import Cluster

USER_MODULES = ("agent", "bus", "snapshot", "services", "testing", "replication")
TRAIN = """
import json, os, sys
import torch
import agent, bus, snapshot, services, testing, replication
import libworker as hvd

hvd.init()
state = hvd.elastic.ObjectState(step=0)


@hvd.elastic.run
def train(state):
    while state.step < 20:
        hvd.allreduce(torch.ones(1))
        state.step += 1
        if state.step %% 5 == 0:
            state.commit()


train(state)
ours = sorted(name for name in sys.modules if name.startswith("elastic_control_plane."))
mine = {name: (sys.modules[name].WHO, sys.modules[name].__file__) for name in %(modules)r}
with open(os.path.join(%(out)r, f"rank-{hvd.rank()}.json"), "w") as out:
    json.dump({"mine": mine, "ours": ours, "size": hvd.size(), "step": state.step}, out)
"""


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "spawned"])
@pytest.mark.parametrize("started_from", ["project", "elsewhere"])
def test_a_users_modules_named_like_ours_are_the_users_and_the_job_trains(
    tmp_path: Path, fork: bool, started_from: str
) -> None:
    project, out, elsewhere = tmp_path / "project", tmp_path / "out", tmp_path / "elsewhere"
    for directory in (project, out, elsewhere):
        directory.mkdir()
    for name in USER_MODULES:
        (project / f"{name}.py").write_text('WHO = "user"\n')
    (project / "train.py").write_text(TRAIN % {"modules": USER_MODULES, "out": str(out)})
    cluster = Cluster(tmp_path / "cluster")  # only for its environment: random ports, a run dir of the test's own
    # elasticctl local's own timing, as users run it: this test is about names, not about the harness's timings.
    unset = ("PYTHONPATH", "ELASTIC_HEARTBEAT", "ELASTIC_MISSED_HEARTBEATS")
    env = {key: value for key, value in cluster.env.items() if key not in unset}
    command = [str(Path(sys.executable).parent / "elasticctl"), "local", "--hosts", "2", "--slots", "1"]
    command += [] if fork else ["--no-fork-server"]
    command += ["--", sys.executable, "train.py" if started_from == "project" else str(project / "train.py")]
    log = tmp_path / "local.log"
    with log.open("wb") as sink:
        local = subprocess.Popen(
            command,
            cwd=project if started_from == "project" else elsewhere,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
    try:
        assert local.wait(timeout=180) == 0, log.read_text()[-4000:]
    finally:
        if local.poll() is None:
            os.killpg(local.pid, signal.SIGKILL)
            local.wait()
    written = sorted(path.name for path in out.iterdir())
    assert written == ["rank-0.json", "rank-1.json"], (written, log.read_text()[-6000:])
    ranks = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(2)]
    for result in ranks:
        assert (result["size"], result["step"]) == (2, 20), result
        assert result["mine"] == {name: ["user", str(project / f"{name}.py")] for name in USER_MODULES}
        held = [name for name in result["ours"] if name.split(".")[1] in ("agent", "services", "replication")]
        assert held == [], f"a worker holds the agent's or the services' modules: {held}"
    assert "while starting" not in log.read_text()
