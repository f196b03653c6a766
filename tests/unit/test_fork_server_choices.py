"""The fork server's pure parts: which jobs can be forked and from which zygote (agent/fork_choice.py), when a process
is not safe to fork (slot_processes/forking.py), and the job options that steer it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from elastic_control_plane.agent.fork_choice import Key, forked_argv, interpreter_identity, key_of, own_key
from elastic_control_plane.agent.fork_server import enabled
from elastic_control_plane.job.plan import JobPlan
from elastic_control_plane.job.spec import JobSpec, SpecError
from elastic_control_plane.slot_processes.forking import fork_hazards, native_threads


def plan(command: list[str], **fields: object) -> JobPlan:
    return JobPlan(1, "key", JobSpec.parse({"command": command, **fields}))


def key(command: list[str], **fields: object) -> Key | None:
    return key_of(plan(command, **fields), os.environ)[0]


def test_a_python_script_or_module_job_is_forked_from_the_zygote_of_its_interpreter() -> None:
    found = key([sys.executable, "train.py", "--lr", "0.1"])
    assert found == own_key(), "the agent's own interpreter's zygote, without preloads, serves it"
    assert found is not None and found.python == sys.executable, "started as named, not resolved"
    assert key([sys.executable, "-m", "pkg.train"]) == found
    assert key(["python3", "train.py"]) is not None, "a python on PATH is found"


def test_a_virtualenvs_python_is_its_own_interpreter_though_it_links_to_the_base_one(tmp_path: Path) -> None:
    base = os.path.realpath(sys.executable)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {os.path.dirname(base)}\n")
    for name in ("python", "python3"):
        (venv / "bin" / name).symlink_to(base)
    found = key([str(venv / "bin" / "python"), "train.py"])
    assert found is not None and found.python == str(venv / "bin" / "python"), (
        "the zygote starts with the venv's python, not the one it links to"
    )
    assert found.interpreter != interpreter_identity(base)
    assert key([str(venv / "bin" / "python3"), "train.py"]) == found, (
        "two names of one venv's python are one interpreter"
    )
    on_path = key_of(plan(["python", "train.py"], env={"PATH": str(venv / "bin")}), {})[0]
    assert on_path is not None and on_path.python == str(venv / "bin" / "python"), "found on the workers' PATH"
    relative = key([os.path.join("venv", "bin", "python"), "train.py"], cwd=str(tmp_path))
    assert relative is not None and relative.interpreter == found.interpreter, (
        "relative to the job's directory, as exec finds it"
    )


@pytest.mark.parametrize(
    "command",
    [
        ["sh", "-c", "python train.py"],
        ["./train"],
        [sys.executable, "-u", "train.py"],
        [sys.executable, "-m"],
        ["python-that-does-not-exist-9", "train.py"],
    ],
)
def test_what_is_not_python_script_args_is_spawned_with_a_reason(command: list[str]) -> None:
    found, why_not = key_of(plan(command), os.environ)
    assert found is None and why_not, why_not


def test_a_job_that_turned_it_off_is_spawned_and_torchrun_mode_forks_its_supervisor() -> None:
    assert key_of(plan([sys.executable, "train.py"], fork_server=False), os.environ) == (
        None,
        "the job turned fork servers off (--no-fork-server)",
    )
    torchrun = plan([sys.executable, "train.py", "--lr", "1"], mode="torchrun")
    assert key_of(torchrun, os.environ)[0] == own_key()
    assert forked_argv(torchrun) == [
        "-m",
        "elastic_control_plane.slot_processes.torchrun_slot",
        "--",
        sys.executable,
        "train.py",
        "--lr",
        "1",
    ]
    assert forked_argv(plan(["sh", "-c", "python train.py"], mode="torchrun")) is None


def test_preloads_and_variables_read_at_start_make_a_zygote_of_their_own_and_the_directory_only_with_preloads() -> None:
    base = key([sys.executable, "train.py"])
    preloading = key([sys.executable, "train.py"], preload=["transformers"])
    with_env = key([sys.executable, "train.py"], env={"OMP_NUM_THREADS": "1"})
    assert len({base, preloading, with_env}) == 3
    assert key([sys.executable, "other.py"], env={"OMP_NUM_THREADS": "1"}) == with_env
    in_project = key([sys.executable, "train.py"], preload=["my_models"], cwd="/srv/project")
    assert in_project is not None and in_project.cwd == "/srv/project", "preloads import from the job's directory"
    assert (
        key([sys.executable, "train.py"], preload=["my_models"], cwd="/srv/project", env={"MY_MODELS_BACKEND": "fast"})
        != in_project
    ), "a preload may read any variable as it imports"
    assert key([sys.executable, "train.py"], cwd="/srv/project") == base, (
        "without preloads, any directory's job shares the zygote"
    )
    assert key([sys.executable, "train.py"], env={"WANDB_PROJECT": "x", "NCCL_DEBUG": "INFO"}) == base, (
        "read after start: the worker takes them"
    )
    assert key([sys.executable, "train.py"], env={"PYTHONPATH": "/srv/lib"}) not in (base, with_env), (
        "sys.path is made as the interpreter starts"
    )


def test_the_environment_switch_turns_it_off() -> None:
    assert enabled({}) and enabled({"ELASTIC_FORK_SERVER": "1"})
    assert not enabled({"ELASTIC_FORK_SERVER": "0"})


def test_the_plan_carries_preloads_and_the_switch_over_the_wire() -> None:
    sent = plan([sys.executable, "train.py"], preload=["numpy", "transformers"], fork_server=False)
    received = JobPlan.from_wire(sent.to_wire())
    assert received.spec.preload == ["numpy", "transformers"] and received.spec.fork_server is False
    assert JobPlan.from_wire({"job": 1, "job_key": "k", "spec": {"command": ["x"]}}).spec.fork_server is True


def test_a_python_thread_is_a_hazard_named_by_its_thread() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="metrics-flusher")
    thread.start()
    try:
        hazards = fork_hazards(native_threads())
        assert (
            len(hazards) == 1 and hazards[0].startswith("Python threads running: ") and "metrics-flusher" in hazards[0]
        ), hazards
    finally:
        stop.set()
        thread.join()


# In a fresh interpreter: this one has threads of other tests.
FRESH_PROCESS_HAZARDS = """
import json, sys, types
from elastic_control_plane.slot_processes.forking import fork_hazards, native_threads
found = {"none": fork_hazards(native_threads()), "native": fork_hazards(native_threads() - 1)}
sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
found["cuda"] = fork_hazards(native_threads())
print(json.dumps(found))
"""


def test_native_threads_beyond_the_allowed_and_cuda_are_hazards() -> None:
    found = json.loads(
        subprocess.run([sys.executable, "-c", FRESH_PROCESS_HAZARDS], capture_output=True, text=True, check=True).stdout
    )
    assert found == {
        "none": [],
        "native": ["1 native thread(s) started by the preloaded modules"],
        "cuda": ["CUDA is initialised"],
    }


def test_the_spec_takes_module_names_to_preload_and_the_switch() -> None:
    spec = JobSpec.parse(
        {"command": ["python", "train.py"], "preload": ["transformers", "my_pkg.models"], "fork_server": False}
    )
    assert spec.preload == ["transformers", "my_pkg.models"] and spec.fork_server is False
    assert JobSpec.parse(spec.to_dict()) == spec
    for bad in ({"preload": "transformers"}, {"preload": ["not a module"]}, {"preload": [""]}, {"fork_server": "no"}):
        with pytest.raises(SpecError):
            JobSpec.parse({"command": ["python", "train.py"], **bad})
