"""The decisions soak in short (bench/decisions_soak.py): a 3 x 1 job on 3 control hosts, a worker killed each cycle
while etcd's leader is paused, quorum is paused, etcd is full, or the active notifier is killed, one of each (the bench
runs hundreds). Every event reaches every agent once and in order, no round is lost or repeated, every killed
worker's exit is in the registry's decision, and the job ends with exit 0 and every commit. A kill while etcd's
leader or its quorum is paused is back at full size within STALL_S (issue 56: a save refused at the end of a pass
and rank 0's store address refused once stalled the round for 81 s; bench/RESULTS.md has the 5 s goal's soak)."""

from __future__ import annotations

from pathlib import Path

from bench.decisions_soak import KINDS, main

STALL_S = 30.0  # a loaded 2-core machine's margin over the bench's 5 s; a stalled round waited 60 s and more


def test_no_decision_or_exit_report_is_lost_or_repeated_while_etcd_stalls_and_refuses(tmp_path: Path) -> None:
    result = main(["--faults", str(len(KINDS)), "--workdir", str(tmp_path / "soak")])
    assert result["faults"] == dict.fromkeys(KINDS, 1), result
    assert result["clean"], result
    paused = result["full_size_after_s"]["leader_stop"] + result["full_size_after_s"]["two_stop"]
    assert max(paused) < STALL_S, result["full_size_after_s"]
