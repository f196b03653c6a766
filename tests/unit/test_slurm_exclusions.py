"""The hosts a requeued Slurm job runs without (slurm/exclusions.py): the driver's record of them, kept over
requeues; their check where discovery takes them (bad input is one line and exit 2, never a traceback); and how
`elasticctl status` says them, naming only the hosts excluded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_control_plane.elasticctl.status import render
from elastic_control_plane.slurm import exclusions

NODE2 = {"host": "node2", "requeue": 1, "reason": "rank 1 exited 1 (--max-restarts 0)"}


def hosts_reply(*blacklisted: str) -> dict:
    return {
        "all": [
            {"host": h, "blacklisted": h in blacklisted, "blacklist_reason": f"{h} failed" if h in blacklisted else ""}
            for h in ("node1", "node2", "node3")
        ]
    }


def test_each_requeue_adds_the_hosts_blacklisted_in_its_run_and_keeps_the_earlier_ones(tmp_path: Path) -> None:
    first = exclusions.merged([], hosts_reply("node2"), requeue=1)
    assert first == [{"host": "node2", "requeue": 1, "reason": "node2 failed"}]
    exclusions.save(tmp_path, first)
    second = exclusions.merged(exclusions.load(tmp_path), hosts_reply("node2", "node3"), requeue=2)
    assert second == [first[0], {"host": "node3", "requeue": 2, "reason": "node3 failed"}]
    exclusions.save(tmp_path, second)
    assert (tmp_path / "exclude").read_text() == "node2,node3\n"  # what the batch script gives ExcNodeList
    assert exclusions.load(tmp_path) == second
    assert exclusions.merged([], {}, requeue=1) == []  # discovery did not answer: nothing new
    assert exclusions.load(tmp_path / "absent") == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("node2", "not JSON"),
        ('{"host": "node2"}', "not a list"),
        ('[{"host": "node2", "requeue": 1}]', "not {host, requeue, reason}"),
        ('[{"host": "", "requeue": 1, "reason": ""}]', "host must be a node name"),
        ('[{"host": "node2,node3", "requeue": 1, "reason": ""}]', "host must be a node name"),
        ('[{"host": "node2", "requeue": 0, "reason": ""}]', "requeue must be a whole number"),
        ('[{"host": "node2", "requeue": true, "reason": ""}]', "requeue must be a whole number"),
        ('[{"host": "node2", "requeue": 1, "reason": 5}]', "reason must be a string"),
    ],
)
def test_bad_input_is_refused_saying_what_is_wrong(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        exclusions.checked(text)


def test_discovery_given_bad_excluded_hosts_says_one_line_and_exits_2(tmp_path: Path) -> None:
    for env, said in (
        ({"ELASTIC_SLURM_JOB": "7", "ELASTIC_SLURM_EXCLUDED": "[1]"}, "--slurm-excluded='[1]': 1: not {host"),
        ({"ELASTIC_SLURM_EXCLUDED": json.dumps([NODE2])}, "only with --slurm-job"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "elastic_control_plane.services.discovery", "--insecure"],
            env={"PATH": "/usr/bin:/bin", "ELASTIC_RUN_DIR": str(tmp_path), **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and said in done.stderr, done.stderr


def test_status_names_each_excluded_host_with_why_and_no_other() -> None:
    job = {"job": 1, "state": "running", "round": 1, "size": 2, "resets": 0, "exit_code": None, "reason": ""}
    node1 = {"host": "node1", "slots": 1, "state": "active", "blacklisted": False}
    view = {"job": job, "hosts": [node1], "workers": [], "history": [], "waits": None, "excluded": [NODE2]}
    lines = [line for line in render(view, 0.0).splitlines() if "excluded" in line]
    assert lines == [
        "  excluded from this allocation: node2 (the job gave up on it before requeue 1: rank 1 exited 1 "
        "(--max-restarts 0))"
    ]
    assert "excluded" not in render({**view, "excluded": []}, 0.0)
