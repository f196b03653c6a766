"""A worker names itself by the pid its agent started (slot_processes.agent_link.worker_pid), even behind a wrapper that
does not exec; the whole path through a real `sh -c` is tests/integration/test_job.py's."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from elastic_control_plane.bus.contract import WorkerEnv
from elastic_control_plane.slot_processes.agent_link import _parent_of, worker_pid


def test_the_parent_of_this_process_is_read_from_proc():
    assert _parent_of(os.getpid()) == os.getppid()
    assert _parent_of(2**22 + 1) == 0, "no such process"


def test_a_process_whose_parent_is_the_agent_is_the_worker(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(WorkerEnv.AGENT_PID, str(os.getppid()))
    assert worker_pid() == os.getpid()


def test_behind_a_wrapper_the_worker_is_the_ancestor_the_agent_started():
    """This process plays the agent: it starts `sh -c` (a wrapper that does not exec), which starts the worker;
    the worker names the shell, the process the agent started."""
    script = "from elastic_control_plane.slot_processes.agent_link import worker_pid; print(worker_pid())"
    wrapper = f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}; echo $$"
    env = {**os.environ, WorkerEnv.AGENT_PID: str(os.getpid())}
    named, shell = subprocess.run(
        ["sh", "-c", wrapper], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(named) == int(shell)


@pytest.mark.parametrize("agent_pid", [None, "not-a-pid", str(2**22 + 1)])
def test_without_the_agent_among_its_ancestors_a_process_is_itself(
    monkeypatch: pytest.MonkeyPatch, agent_pid: str | None
):
    if agent_pid is None:
        monkeypatch.delenv(WorkerEnv.AGENT_PID, raising=False)
    else:
        monkeypatch.setenv(WorkerEnv.AGENT_PID, agent_pid)
    assert worker_pid() == os.getpid()
