"""The fork server's pure parts: which jobs can be forked and from which zygote (agent/fork_server.py), when a process
is not safe to fork (libworker/zygote.py), and the job options that steer it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

import os

from agent.fork_server import Key, enabled, key_of
from bus.contract import JobPlan
from bus.service import RequestError
from libworker.zygote import fork_hazards, native_threads
from services.registry.jobspec import JobSpec


def plan(command: list[str], **fields: object) -> JobPlan:
    return JobPlan(job=1, command=command, **fields)  # type: ignore[arg-type]


def test_a_python_script_or_module_job_is_forked_from_the_zygote_of_its_interpreter() -> None:
    key = key_of(plan([sys.executable, "train.py", "--lr", "0.1"]))
    assert key == Key(os.path.realpath(sys.executable), (), (), ""), "the zygote of the interpreter itself, without preloads"
    assert key_of(plan([sys.executable, "-m", "pkg.train"])) == key
    assert key_of(plan(["python3", "train.py"])) is not None, "a python on PATH is found"


@pytest.mark.parametrize("command", [["sh", "-c", "python train.py"], ["./train"], [sys.executable, "-u", "train.py"], [sys.executable, "-m"],
                                     ["python-that-does-not-exist-9", "train.py"]])
def test_what_is_not_python_script_args_is_spawned(command: list[str]) -> None:
    assert key_of(plan(command)) is None


def test_torchrun_mode_and_a_job_that_turned_it_off_are_spawned() -> None:
    assert key_of(plan([sys.executable, "train.py"], mode="torchrun")) is None
    assert key_of(plan([sys.executable, "train.py"], fork_server=False)) is None


def test_preloads_the_jobs_environment_and_directory_make_a_zygote_of_their_own() -> None:
    base = key_of(plan([sys.executable, "train.py"]))
    preloading = key_of(plan([sys.executable, "train.py"], preload=("transformers",)))
    with_env = key_of(plan([sys.executable, "train.py"], env={"OMP_NUM_THREADS": "1"}))
    assert len({base, preloading, with_env}) == 3
    assert key_of(plan([sys.executable, "other.py"], env={"OMP_NUM_THREADS": "1"})) == with_env
    in_project = key_of(plan([sys.executable, "train.py"], preload=("my_models",), cwd="/srv/project"))
    assert in_project is not None and in_project.cwd == "/srv/project", "preloads import from the job's directory"


def test_the_environment_switch_turns_it_off() -> None:
    assert enabled({}) and enabled({"ELASTIC_FORK_SERVER": "1"})
    assert not enabled({"ELASTIC_FORK_SERVER": "0"})


def test_the_plan_carries_preloads_and_the_switch_over_the_wire() -> None:
    sent = plan([sys.executable, "train.py"], preload=("numpy", "transformers"), fork_server=False)
    received = JobPlan.from_wire(sent.to_wire() | {"preload": ["numpy", "transformers"]})
    assert received.preload == ("numpy", "transformers") and received.fork_server is False
    assert JobPlan.from_wire({"job": 1, "command": ["x"]}).fork_server is True, "an older plan forks"


def test_a_python_thread_is_a_hazard_named_by_its_thread() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="metrics-flusher")
    thread.start()
    try:
        hazards = fork_hazards(native_threads())
        assert len(hazards) == 1 and hazards[0].startswith("Python threads running: ") and "metrics-flusher" in hazards[0], hazards
    finally:
        stop.set()
        thread.join()


# In a fresh interpreter: this one has threads of other tests.
FRESH_PROCESS_HAZARDS = """
import json, sys, types
from libworker.zygote import fork_hazards, native_threads
found = {"none": fork_hazards(native_threads()), "native": fork_hazards(native_threads() - 1)}
sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
found["cuda"] = fork_hazards(native_threads())
print(json.dumps(found))
"""


def test_native_threads_beyond_the_allowed_and_cuda_are_hazards() -> None:
    found = json.loads(subprocess.run([sys.executable, "-c", FRESH_PROCESS_HAZARDS], capture_output=True, text=True, check=True).stdout)
    assert found == {"none": [], "native": ["1 native thread(s) started by the preloaded modules"], "cuda": ["CUDA is initialised"]}


def test_the_spec_takes_module_names_to_preload_and_the_switch() -> None:
    spec = JobSpec.parse({"command": ["python", "train.py"], "preload": ["transformers", "my_pkg.models"], "fork_server": False})
    assert spec.preload == ["transformers", "my_pkg.models"] and spec.fork_server is False
    assert JobSpec.parse(spec.to_dict()) == spec
    for bad in ({"preload": "transformers"}, {"preload": ["not a module"]}, {"preload": [""]}, {"fork_server": "no"}):
        with pytest.raises(RequestError):
            JobSpec.parse({"command": ["python", "train.py"], **bad})

