"""The decisions soak in short (bench/decisions_soak.py): a 3 x 1 job on 3 control hosts, a worker killed each cycle
while etcd's leader is paused, quorum is paused, etcd is full, or the active notifier is killed, one of each (the bench
runs hundreds). Every event reaches every agent once and in order, no round is lost or repeated, every killed
worker's exit is in the registry's decision, and the job ends with exit 0 and every commit."""

from __future__ import annotations

from pathlib import Path

from bench.decisions_soak import KINDS, main


def test_no_decision_or_exit_report_is_lost_or_repeated_while_etcd_stalls_and_refuses(tmp_path: Path) -> None:
    result = main(["--faults", str(len(KINDS)), "--workdir", str(tmp_path / "soak")])
    assert result["faults"] == dict.fromkeys(KINDS, 1), result
    assert result["clean"], result
