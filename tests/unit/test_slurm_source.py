"""Discovery's Slurm source (services/discovery/slurm.py) against stand-ins for Slurm's squeue and sinfo on the
PATH, printing what the real ones printed: the host list follows the job's nodes and their states, a change wakes
the discovery loop, and Slurm not answering keeps the last list, said once."""

from __future__ import annotations

import os
import select
from pathlib import Path
from typing import Any

import pytest

from elastic_control_plane.services.discovery.slurm import BACKOFF_MAX, SlurmSource, next_wait


class Said:
    """A logger that keeps what was said."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def info(self, event: str, **_: Any) -> None:
        self.events.append(event)

    warning = info


@pytest.fixture
def slurm_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """squeue and sinfo that print the files squeue.txt and sinfo.txt, or exit 1 while fail exists."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for command in ("squeue", "sinfo"):
        script = bin_dir / command
        script.write_text(
            f'#!/bin/sh\n[ -e "{tmp_path}/fail" ] && {{ echo "slurm_load_jobs error: connect failure" >&2; exit 1; }}\n'
            f'cat "{tmp_path}/{command}.txt"\n'
        )
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return tmp_path


def test_the_host_list_follows_the_job_its_node_states_and_slurms_outages(slurm_bin: Path) -> None:
    (slurm_bin / "squeue.txt").write_text("10|N/A|(null)|node[1-3]\n11|N/A|(null)|node4\n")
    (slurm_bin / "sinfo.txt").write_text("node1|mixed\nnode2|mixed\nnode3|mixed\nnode4|mixed\n")
    said = Said()
    source = SlurmSource("10", said)
    try:
        assert source.hosts() is None
        source.look()
        assert select.select([source.fileno()], [], [], 0)[0], "a new list wakes the loop"
        assert source.take() == {"node1": None, "node2": None, "node3": None}
        assert not select.select([source.fileno()], [], [], 0)[0]

        (slurm_bin / "sinfo.txt").write_text("node1|mixed\nnode2|down\nnode3|mixed*\nnode4|mixed\n")
        source.look()
        assert source.take() == {"node1": None, "node3": None}  # DOWN out at once; not responding: heartbeats decide
        assert source.take_lost() == {"node2"}  # a lost host for discovery, once
        (slurm_bin / "squeue.txt").write_text("10|N/A|(null)|node[1,3]\n11|N/A|(null)|node4\n")  # --no-kill: shrunk
        source.look()
        assert source.take_lost() == set()

        (slurm_bin / "fail").touch()
        source.look()
        source.look()
        assert source.hosts() == {"node1": None, "node3": None}
        assert said.events.count("slurm_unavailable") == 1
        (slurm_bin / "fail").unlink()
        (slurm_bin / "squeue.txt").write_text("10|N/A|(null)|node[1-3]\n12|N/A|elastic-join=10|node4\n")
        source.look()
        assert source.take() == {"node1": None, "node3": None, "node4": None}  # an allocation joined
        assert "slurm_recovered" in said.events
    finally:
        source.stop()


def test_a_node_of_the_job_set_down_after_it_left_the_allocation_is_lost_and_no_other(slurm_bin: Path) -> None:
    """With --no-kill, Slurm takes a DOWN node out of the job's node list: it is still the job's lost node; a node
    of another job that goes DOWN, or one only not responding, is not."""
    (slurm_bin / "squeue.txt").write_text("10|N/A|(null)|node[1-2]\n11|N/A|(null)|node3\n")
    (slurm_bin / "sinfo.txt").write_text("node1|mixed\nnode2|mixed\nnode3|mixed\n")
    source = SlurmSource("10", Said())
    try:
        source.look()
        assert source.take_lost() == set()
        (slurm_bin / "squeue.txt").write_text("10|N/A|(null)|node1\n11|N/A|(null)|node3\n")
        (slurm_bin / "sinfo.txt").write_text("node1|mixed*\nnode2|down\nnode3|down\n")
        source.look()
        assert source.take() == {"node1": None}
        assert source.take_lost() == {"node2"}
        (slurm_bin / "sinfo.txt").write_text("node1|mixed\nnode2|idle\nnode3|down\n")  # node2 resumed
        source.look()
        (slurm_bin / "sinfo.txt").write_text("node1|mixed\nnode2|down\nnode3|down\n")  # and down again
        source.look()
        assert source.take_lost() == {"node2"}
    finally:
        source.stop()


def test_looks_are_poll_seconds_apart_and_twice_as_far_each_time_slurm_does_not_answer() -> None:
    waits, wait = [], 0.0
    for answered in (True, False, False, False, False, False, False, True):
        wait = next_wait(answered, wait, 5.0)
        waits.append(wait)
    assert waits == [5.0, 10.0, 20.0, 40.0, BACKOFF_MAX, BACKOFF_MAX, BACKOFF_MAX, 5.0]
