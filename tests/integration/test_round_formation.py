"""A round that failed to form leaves nothing behind that keeps the next one from forming.

A peer killed while a round's process group connects makes the survivors'
formation time out. The round after, they form a group with a replacement, a
fresh process: both must name the group alike. (torch names it by a
process-wide count of groups made, which only the destruction of a group that
formed resets: before the fix a survivor looked for group "1" while the
replacement wrote group "0", and every later round of the job timed out
forming; found by test_clean_exit under load.)

And a peer that dies before it reaches the round's store, or after it but
before gloo connected it to the others, ends the others' wait for it at the
control plane's abort, not after the collective timeout (the second was found
by test_clean_exit under load in CI: the survivors sat in gloo's store wait
until the registry judged them hung). One that dies after it published its
address, while gloo connects the pairs, ends the others' wait at the collective
timeout (found by test_clean_exit in CI too: gloo waited five times the group's
timeout, which outlasted the hung timeout, and the job failed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_control_plane.bus.config import Timing
from libworker.errors import WorkerInternalError
from libworker.forming_store import AbortableStore, RoundFormationAborted
from libworker.world import ARRIVED_KEY, _await_every_rank, world
from testing.harness import REPO, Cluster, free_ports
from tests.integration.training import JOB


def test_a_survivor_of_a_round_that_failed_to_form_forms_the_next_with_a_fresh_replacement() -> None:
    port = free_ports(1)[0]
    worker = [sys.executable, "tests/workers/form_round.py", str(port)]
    run = {
        "cwd": REPO,
        "env": {**os.environ, "PYTHONPATH": str(REPO)},
        "stdout": subprocess.PIPE,
        "stderr": subprocess.STDOUT,
        "text": True,
    }
    survivor = subprocess.Popen([*worker, "0", "2", "1"], **run)
    replacement = subprocess.Popen([*worker, "1", "2"], **run)
    try:
        outputs = [process.communicate(timeout=60)[0] for process in (survivor, replacement)]
    finally:
        for process in (survivor, replacement):
            process.kill()
            process.wait()
    assert [process.returncode for process in (survivor, replacement)] == [0, 0], outputs
    assert all("allreduce gave 3" in output for output in outputs), outputs


@pytest.fixture
def round_3_of_2_ranks(monkeypatch: pytest.MonkeyPatch) -> dist.Store:
    """This process as rank 0 of round 3 (size 2), with the round's TCPStore served here; its peer never comes."""
    monkeypatch.setattr(world, "slot", {"rank": 0, "size": 2, "prefix": "round/3/"})
    monkeypatch.setattr(world, "round", 3)
    monkeypatch.setattr(world, "aborted_round", 0)
    monkeypatch.setattr(world, "poisoned", False)
    monkeypatch.setattr(world, "timing", Timing(collective_timeout=30.0))
    return dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)


def test_a_round_whose_peer_died_before_arriving_stops_forming_at_the_abort(round_3_of_2_ranks: dist.Store) -> None:
    threading.Timer(0.3, world.abort_round, args=(3,)).start()
    started = time.monotonic()
    with pytest.raises(WorkerInternalError, match=r"round 3 aborted while it formed \(1 of 2 ranks had arrived\)"):
        _await_every_rank(round_3_of_2_ranks)
    assert time.monotonic() - started < 5.0
    assert world.poisoned


def test_an_abort_that_overtook_the_joins_answer_still_ends_the_round_it_was_for(
    round_3_of_2_ranks: dist.Store,
) -> None:
    world.round = 2
    world.abort_round(3)
    world.abort_round(1)
    world.round = 3
    with pytest.raises(WorkerInternalError, match="round 3 aborted"):
        _await_every_rank(round_3_of_2_ranks)


def test_a_round_forms_once_every_rank_has_arrived(round_3_of_2_ranks: dist.Store) -> None:
    peer = dist.TCPStore("127.0.0.1", round_3_of_2_ranks.port, 2, is_master=False, timeout=timedelta(seconds=30))
    threading.Timer(0.2, peer.add, args=(ARRIVED_KEY, 1)).start()
    _await_every_rank(round_3_of_2_ranks)
    assert not world.poisoned


def test_a_gloo_group_whose_peer_never_connects_stops_forming_at_the_abort() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    aborted = threading.Event()
    threading.Timer(0.3, aborted.set).start()
    started = time.monotonic()
    with pytest.raises(RoundFormationAborted, match="aborted while its process group formed"):
        dist.ProcessGroupGloo(AbortableStore(store, aborted.is_set), 0, 2, timedelta(seconds=60))
    assert time.monotonic() - started < 5.0


def test_a_gloo_group_of_ranks_that_all_connect_forms_and_reduces_on_the_abortable_store() -> None:
    master = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    stores = [master, dist.TCPStore("127.0.0.1", master.port, 2, is_master=False, timeout=timedelta(seconds=60))]
    sums: dict[int, float] = {}

    def rank(number: int) -> None:
        group = dist.ProcessGroupGloo(AbortableStore(stores[number], lambda: False), number, 2, timedelta(seconds=60))
        tensor = torch.tensor([float(number + 1)])
        group.allreduce([tensor]).wait()
        sums[number] = float(tensor.item())

    threads = [threading.Thread(target=rank, args=(number,)) for number in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sums == {0: 3.0, 1: 3.0}


@pytest.mark.parametrize("die_at", ["arrival", "connect"])
def test_a_worker_killed_after_reaching_the_store_does_not_leave_its_peers_to_be_judged_hung(
    cluster: Cluster, tmp_path: Path, die_at: str
) -> None:
    """Killed before it published its gloo address (`arrival`), or after (`connect`: the peers wait for it to
    connect, in gloo, where no abort reaches them; they give up at the collective timeout)."""
    for host in ("host-1", "host-2"):
        cluster.start_agent(host, 2, ["--standby", "0"])
    mark = tmp_path / "died"
    job = cluster.submit(
        "--min-np",
        "2",
        "--hung-timeout",
        "60",
        "--env",
        "DIE_ON_HOST=host-2",
        "--env",
        f"DIED_MARK={mark}",
        "--env",
        f"DIE_AT={die_at}",
        "--",
        JOB[0],
        "tests/workers/dies_while_forming.py",
        "--epochs",
        "2",
        "--samples",
        "256",
        "--step-delay",
        "0.01",
    )
    assert cluster.wait_job_end(job, 240) == 0, cluster.output("elasticctl-run")
    assert mark.exists()
    reasons = [worker["reason"] for worker in cluster.call("registry", "status")["workers"]]
    assert not [reason for reason in reasons if "hung" in reason], reasons
