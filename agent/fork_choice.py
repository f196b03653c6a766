"""Which zygote can fork a job's workers (a `Key`), or why none can: the job's interpreter, preloads and environment.

One zygote serves every job that agrees on its `Key`: the interpreter (`interpreter_identity`: the binary and, for a
virtualenv's python, the virtualenv), the `--preload` modules, the job's `--env` variables read as a process starts
(`READ_AT_START`: PYTHONPATH, OMP_*, LD_*, ...) and, only where there are preloads (the job's own modules, imported in
the zygote), the working directory and every variable of `--env`. The job's interpreter is found as a worker's exec
would find it (`find_python`) and never resolved further: a virtualenv's python is a symlink, and resolving it would
leave the virtualenv and its packages. Only `python SCRIPT` and `python -m MODULE` can be forked (`script_argv`); a
torchrun-mode job's forked worker is the slot's supervisor around its command (`forked_argv`). Pure choices, driven by
tests/unit/test_fork_server_choices.py; agent/fork_server.py starts and asks the zygotes.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastic_control_plane.job.plan import JobPlan
from elastic_control_plane.slot_processes.warm_start import script_argv

TORCHRUN_SUPERVISOR = ["-m", "elastic_control_plane.slot_processes.torchrun_slot", "--"]
# The job's variables an interpreter, the dynamic loader or a library torch loads reads once, as it starts (sys.path,
# OpenMP and BLAS thread pools, allocators, torch's import-time switches): a zygote started without them cannot take
# them on. Every other variable a worker gets when it starts, which is all a variable read later needs.
READ_AT_START = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "MALLOC_", "TORCH")


@dataclass(frozen=True)
class Key:
    """What a zygote is started with: one zygote serves the jobs that agree on all of it but `python` (the path it
    is started with, as the job names it)."""

    interpreter: str
    preload: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    cwd: str  # where the preloads are imported from ("": no preloads, or the agent's directory)
    python: str = field(compare=False)


def interpreter_identity(python: str) -> str:
    """What makes two paths the same interpreter: the binary they run and, for a virtualenv's python (a symlink out
    of the environment, which the environment's pyvenv.cfg changes the meaning of), the virtualenv."""
    environment = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    venv = environment if os.path.isfile(os.path.join(environment, "pyvenv.cfg")) else ""
    real = os.path.realpath(python)
    return f"{real} in {venv}" if venv else real


@functools.cache
def own_key() -> Key:
    """The zygote of the agent's own interpreter, with no preloads and no job environment: prepared at the agent's
    start, it serves every job run with the same python."""
    return Key(interpreter_identity(sys.executable), (), (), "", sys.executable)


def forked_argv(plan: JobPlan) -> list[str] | None:
    """What a forked worker of the job runs (the script's arguments, or the torchrun supervisor's around the
    command); None when the command is not a Python script."""
    argv = script_argv(plan.spec.command)
    if argv is None or plan.spec.mode != "torchrun":
        return argv
    return [*TORCHRUN_SUPERVISOR, *plan.spec.command]


def find_python(command: str, env: Mapping[str, str], cwd: str | None) -> str | None:
    """The job's interpreter as a worker's exec would find it: on the workers' PATH, or relative to the job's
    directory; not resolved further (a virtualenv's python must stay itself)."""
    if os.sep in command:
        path = os.path.join(cwd or os.getcwd(), command)
        return os.path.abspath(path) if os.access(path, os.X_OK) else None
    found = shutil.which(command, path=env.get("PATH", os.defpath))
    return os.path.abspath(found) if found else None


def key_of(plan: JobPlan, base_env: Mapping[str, str]) -> tuple[Key | None, str]:
    """The zygote a job's workers can be forked from, or None and why they cannot (not a Python script, the job
    turned fork servers off, its python is not found)."""
    if not plan.spec.fork_server:
        return None, "the job turned fork servers off (--no-fork-server)"
    if forked_argv(plan) is None:
        return None, f"the command is not `python SCRIPT` or `python -m MODULE`: {shlex.join(plan.spec.command)[:200]}"
    python = find_python(plan.spec.command[0], {**base_env, **plan.spec.env}, plan.cwd)
    if python is None:
        return None, f"{plan.spec.command[0]} is not found"
    if plan.spec.preload:  # the job's own modules are imported in the zygote: from its directory, reading any variable
        return Key(
            interpreter_identity(python),
            tuple(plan.spec.preload),
            tuple(sorted(plan.spec.env.items())),
            plan.spec.cwd,
            python,
        ), ""
    read_at_start = tuple(
        sorted((name, value) for name, value in plan.spec.env.items() if name.startswith(READ_AT_START))
    )
    return Key(interpreter_identity(python), (), read_at_start, "", python), ""
