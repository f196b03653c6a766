"""`elasticctl` following a live control plane (issue 10): `run` rides through a 10 s registry outage and exits
with the job's code, `status --watch` redraws until Ctrl-C, `events` prints the notifier's history and
`events --follow` new events; bad values of the new options are one line, exit 2."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import pytest

from elastic_control_plane.elasticctl.outage import UNREACHABLE
from testing.harness import REPO, Cluster, free_ports, read_events, wait_for

OUTAGE = 10.0
BACK = re.compile(r"\[elasticctl\] control plane reachable again after ([0-9.]+)s")


def _seq_and_type(line: str) -> tuple[int, str]:
    """The sequence number and event type of an `elasticctl events` line: `DATE TIME seq=N TYPE ...`."""
    found = re.fullmatch(r"\S+ \S+ seq=(\d+) (\S+)( .*)?", line)
    assert found, line
    return int(found.group(1)), found.group(2)


def _clean_env(**extra: str) -> dict[str, str]:
    """This machine's environment without any ELASTIC_* setting, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}, "PYTHONPATH": str(REPO), **extra}


class Output:
    """The lines a process writes to a pipe, read by a thread as they come."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        return "\n".join(self.lines)

    def read_to_the_end(self) -> str:
        """Everything, once the process has exited and the pipe is closed."""
        self._reader.join(timeout=10)
        return self.text()


@contextmanager
def elasticctl_piped(cluster: Cluster, *args: str) -> Iterator[tuple[subprocess.Popen[str], Output]]:
    """`elasticctl ARGS` with its output on a pipe (not a terminal); killed on the way out if still running."""
    process = subprocess.Popen(
        [sys.executable, "-m", "elastic_control_plane.elasticctl.main", *args],
        env=cluster.env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    try:
        yield process, Output(process.stdout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()


def _stop_with_ctrl_c(process: subprocess.Popen[str], output: Output) -> None:
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=10) == 0, output.text()
    assert "Traceback" not in output.read_to_the_end(), output.text()


def test_run_rides_through_a_ten_second_registry_outage(cluster: Cluster) -> None:
    cluster.start_agent("host-1", 1)
    log_dir = cluster.workdir / "events"
    job = cluster.submit(
        "--",
        sys.executable,
        "tests/workers/counter.py",
        "--batches",
        "150",
        "--step-delay",
        "0.05",
        "--log-dir",
        str(log_dir),
    )
    wait_for(lambda: any(e["event"] == "commit" for e in read_events(log_dir)), 60, "the job to commit")
    registry = cluster.processes["registry"]
    stopped_at = time.monotonic()
    registry.send_signal(signal.SIGSTOP)
    try:
        wait_for(
            lambda: UNREACHABLE in cluster.output("elasticctl-run"),
            OUTAGE - 1,
            "elasticctl run to say the control plane is unreachable",
        )
        assert job.poll() is None, cluster.output("elasticctl-run")
        time.sleep(max(0.0, stopped_at + OUTAGE - time.monotonic()))  # the outage is the subject: it lasts 10 s
    finally:
        registry.send_signal(signal.SIGCONT)
    assert cluster.wait_job_end(job, 60) == 0, cluster.output("elasticctl-run")
    output = cluster.output("elasticctl-run")
    assert output.count(UNREACHABLE) == 1, output
    back = BACK.findall(output)
    assert len(back) == 1 and OUTAGE - 2 < float(back[0]) < OUTAGE + 5, output
    assert output.index(UNREACHABLE) < output.index("reachable again") < output.index("job 1 succeeded"), output
    assert "Traceback" not in output


def test_status_watch_redraws_the_table_until_ctrl_c(cluster: Cluster) -> None:
    cluster.start_agent("host-1", 1)
    with elasticctl_piped(cluster, "status", "--watch", "--interval", "0.2") as (process, output):
        wait_for(lambda: sum(line.startswith("host-1 ") for line in output.lines) >= 2, 15, "two tables showing host-1")
        _stop_with_ctrl_c(process, output)
    assert "\x1b[" not in output.text(), "no terminal escapes on a pipe"
    assert output.text().count("elasticctl status, every 0.2s") >= 2


def test_events_prints_the_history_in_order_and_follows_new_events(cluster: Cluster) -> None:
    cluster.start_agent("host-1", 1)
    job = cluster.submit("--", sys.executable, "-c", "import libworker as e; e.init(); e.barrier()")
    assert cluster.wait_job_end(job, 60) == 0, cluster.output("elasticctl-run")
    wait_for(
        lambda: "job_finished" in cluster.elasticctl("events").stdout, 15, "the notifier to have the job_finished event"
    )

    history = cluster.elasticctl("events")
    assert history.returncode == 0, history.stderr
    lines = history.stdout.splitlines()
    seqs, kinds = zip(*map(_seq_and_type, lines))
    assert list(seqs) == sorted(set(seqs)), lines
    assert "round" in kinds and "job_finished" in kinds and kinds.index("round") < kinds.index("job_finished"), lines
    assert "round=1 size=1 hosts=host-1:1 job=1" in lines[kinds.index("round")]
    assert "job=1 state=succeeded exit_code=0" in lines[kinds.index("job_finished")]
    assert "heartbeat" not in history.stdout
    assert cluster.elasticctl("events", "--since", str(seqs[-2])).stdout.splitlines() == lines[-1:]

    with elasticctl_piped(cluster, "events", "--follow") as (process, output):
        wait_for(lambda: "job_finished" in output.text(), 15, "events --follow to print the history")
        assert cluster.elasticctl("drain", "host-1").returncode == 0
        drained = wait_for(
            lambda: next(
                (line for line in output.lines if " hosts_updated added=false removed=true changed=-host-1" in line),
                None,
            ),
            15,
            "the drain's event",
        )
        _stop_with_ctrl_c(process, output)
    assert _seq_and_type(drained)[0] > seqs[-1], drained


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["status", "--watch", "--interval", "0"],
            "elasticctl: --interval must be a positive number of seconds (got 0)",
        ),
        (["status", "--interval", "2"], "elasticctl: --interval needs --watch"),
        (["events", "--since", "-5"], "elasticctl: --since must be at least 0 (got -5)"),
        (
            ["events", "--follow", "--since", "many"],
            "elasticctl: Invalid value for '--since': 'many' is not a valid integer.",
        ),
    ],
)
def test_bad_values_of_the_follow_options_are_one_line_exit_2(args: list[str], line: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.elasticctl.main", *args],
        env=_clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (result.returncode, result.stderr.splitlines(), result.stdout) == (2, [line], "")


def test_events_follow_needs_the_notifier_when_it_starts() -> None:
    port = free_ports(1)[0]
    env = _clean_env(ELASTIC_NOTIFIER_ENDPOINT=f"tcp://127.0.0.1:{port}")
    result = subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "events", "--follow"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (result.returncode, result.stderr.splitlines()) == (
        1,
        [f"elasticctl: cannot reach the notifier at tcp://127.0.0.1:{port}: is the control plane up? (no reply)"],
    )
