"""A round that failed to form leaves nothing behind that keeps the next one from forming.

A peer killed while a round's process group connects makes the survivors'
formation time out. The round after, they form a group with a replacement, a
fresh process: both must name the group alike. (torch names it by a
process-wide count of groups made, which only the destruction of a group that
formed resets: before the fix a survivor looked for group "1" while the
replacement wrote group "0", and every later round of the job timed out
forming; found by test_clean_exit under load.)

And a peer that dies before it reaches the round's store ends the others'
wait for it at the control plane's abort, not after the collective timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_control_plane.bus.config import Timing
from libworker.errors import WorkerInternalError
from libworker.world import ARRIVED_KEY, _await_every_rank, world
from testing.harness import REPO, free_ports


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
