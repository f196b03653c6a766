"""`elasticctl slurm`'s batch script and arguments (slurm/script.py, elasticctl/slurm.py) and the requeue decision
(slurm/requeue.py); a rendered script is checked by bash itself (`bash -n`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_control_plane.elasticctl.slurm import slurm, split_arguments
from elastic_control_plane.slurm.job_end import exit_status
from elastic_control_plane.slurm.requeue import FINISHED, GAVE_UP, REQUEUE, decide

ELASTICCTL = [sys.executable, "-m", "elastic_control_plane.elasticctl.main"]


def elasticctl(*args: str, cwd: Path, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"PATH": path} if path is not None else {})}
    return subprocess.run([*ELASTICCTL, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=60)


def test_arguments_are_split_into_ours_the_jobs_sbatchs_and_the_command() -> None:
    own, run, sbatch, command = split_arguments(
        slurm,
        "-N 4 --gpus-per-node=8 --exclusive -A acct --min-np 2 -p gpu --mail-type=END --blacklist-cooldown 1 2 "
        "--no-fork-server -- python train.py --lr 0.1".split(),
    )
    assert own == ["-N", "4", "--gpus-per-node=8", "-p", "gpu"]
    assert run == ["--min-np", "2", "--blacklist-cooldown", "1", "2", "--no-fork-server"]
    assert sbatch == ["--exclusive", "-A", "acct", "--mail-type=END"]
    assert command == ["python", "train.py", "--lr", "0.1"]


def test_the_dry_run_prints_the_script_with_slurms_options_unchanged(tmp_path: Path) -> None:
    done = elasticctl(
        "slurm", "-N", "4", "--gpus-per-node", "8", "-p", "gpu", "--time", "2:00:00", "--exclusive", "-A", "my acct",
        "--checkpoint-dir", "ck", "--min-np", "8", "--dry-run", "--", "python", "train.py", "--name", "a b",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    script = done.stdout
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=2:00:00",
        "#SBATCH --no-kill",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=B:USR1@180",
        "#   sbatch --exclusive -A 'my acct' SCRIPT",
        f'if [ "$rc" -eq {REQUEUE} ]; then',
        "  trap '' TERM",
        '  scontrol requeue "$SLURM_JOB_ID" || exit 1',
    ):
        assert any(have.split("  #")[0] == line for have in script.splitlines()), line
    driver = next(line for line in script.splitlines() if "elastic_control_plane.slurm.batch" in line)
    assert f"--state-dir {tmp_path}/.elastic-slurm --gpus-per-node 8 --control-hosts 1" in driver
    assert f"-- --checkpoint-dir {tmp_path}/ck --min-np 8 -- python train.py --name 'a b' &" in driver
    script_file = tmp_path / "job.sh"
    script_file.write_text(script)
    assert subprocess.run(["bash", "-n", str(script_file)]).returncode == 0


def test_a_joining_allocation_runs_agents_only(tmp_path: Path) -> None:
    done = elasticctl("slurm", "-N", "2", "--join", "123", "--dry-run", "--", "python", "train.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --comment=elastic-join=123" in done.stdout
    assert "--requeue" not in done.stdout and "--join 123" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-N", "2", "python", "train.py"], "missing `-- COMMAND`"),
        (["-N", "2", "stray", "--", "python"], "unexpected 'stray'"),
        (["-N", "2", "-w", "node[1-", "--", "python"], "-w: not a host list: 'node[1-'"),
        (["-N", "2", "--exclude=a]", "--", "python"], "--exclude: not a host list"),
        (["--", "python"], "-N/--nodes is required"),
        (["-N", "0", "--", "python"], "-N"),
        (["-N", "2", "--min-np", "0", "--", "python"], "--min-np must be at least 1"),
        (["-N", "2", "--signal-before", "5", "--", "python"], "--signal-before"),
        (["-N", "2", "--signal-before", "60", "--", "python"], "--signal-before"),  # under the drain's 90 s
        (["-N", "2", "--signal=B:USR2@60", "--", "python"], "sbatch's --signal: elasticctl slurm sets"),
        (["-N", "2", "--no-requeue", "--", "python"], "use --max-requeues 0"),
        (["-N", "2", "-n", "8", "--", "python"], "sbatch's -n: the allocation runs one agent per node"),
        (["-N", "2", "--ntasks-per-node=2", "--", "python"], "sbatch's --ntasks-per-node"),
        (["-N", "2", "--output=train.log", "--", "python"], "sbatch's --output without --open-mode=append"),
        (["-N", "2", "-e", "err.log", "--", "python"], "sbatch's -e without --open-mode=append"),
        (["-N", "2", "--open-mode=truncate", "--", "python"], "sbatch's --open-mode: a requeued run must add"),
        (
            ["-N", "3", "--control-hosts", "2", "--", "python"],
            "--control-hosts 2: a replicated control plane needs an odd",
        ),
        (["-N", "3", "--control-hosts", "5", "--", "python"], "--control-hosts 5: more than the job's 3 node(s) (-N)"),
        (["-N", "3", "--control-hosts", "3", "--control", "a,b,c", "--", "python"], "--control-hosts 3 and --control"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    done = elasticctl("slurm", *args, "--dry-run", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr


def test_sbatchs_options_that_keep_the_protocol_pass_and_wait_is_elasticctls(tmp_path: Path) -> None:
    """The innocent twins of the refused options: an output kept across runs, a signal-before the drain fits in,
    sbatch's options that touch nothing of the protocol; `--wait` is elasticctl's (slurm/job_end.py), not sbatch's."""
    args = ["-N", "2", "--output=train-%j.log", "--open-mode=append", "--signal-before", "100", "--exclusive"]
    done = elasticctl("slurm", *args, "--wait", "--dry-run", "--", "python", "train.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "#   sbatch --output=train-%j.log --open-mode=append --exclusive SCRIPT" in done.stdout
    assert "#SBATCH --signal=B:USR1@100" in done.stdout


@pytest.mark.parametrize(
    ("exit_code", "status"), [("0:0", 0), ("3:0", 3), ("0:15", 1), ("0:9", 1), ("", 1), ("x:0", 1)]
)
def test_a_waited_jobs_exit_code_is_the_one_sbatch_wait_gives(exit_code: str, status: int) -> None:
    assert exit_status(exit_code) == status


def test_a_replicated_control_plane_in_the_allocation_is_in_the_script(tmp_path: Path) -> None:
    done = elasticctl("slurm", "-N", "3", "--control-hosts", "3", "--dry-run", "--", "python", "train.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    driver = next(line for line in done.stdout.splitlines() if "elastic_control_plane.slurm.batch" in line)
    assert f"--state-dir {tmp_path}/.elastic-slurm --control-hosts 3 --max-requeues" in driver


def test_a_replicated_control_plane_without_etcd_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # a PATH without etcd
    bin_dir.mkdir()
    args = ("slurm", "-N", "3", "--control-hosts", "3", "--", "python", "train.py")
    done = elasticctl(*args, cwd=tmp_path, path=str(bin_dir))
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "elasticctl: --control-hosts 3: etcd is not on PATH: "
        "apt-get install etcd-server etcd-client (etcd 3.4 or later)"
    )


def test_no_slurm_on_the_machine_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # a PATH with this interpreter and no Slurm command
    bin_dir.mkdir()
    done = elasticctl("slurm", "-N", "2", "--", "python", "train.py", cwd=tmp_path, path=str(bin_dir))
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "elasticctl: sbatch is not installed: Slurm's client commands are needed (apt-get install slurm-client)"
    )
    joined = elasticctl("slurm", "-N", "2", "--join", "5", "--", "python", cwd=tmp_path, path=str(bin_dir))
    assert joined.returncode == 2 and "scontrol is not installed" in joined.stderr


@pytest.mark.parametrize(
    ("job_exit", "preempted", "restarts", "before", "after", "code"),
    [
        (0, False, 0, 0, 50, FINISHED),  # the job finished
        (None, True, 0, 0, 50, REQUEUE),  # preempted after commit 50: resume from it
        (None, True, 0, 0, 0, REQUEUE),  # preempted before any commit: start afresh
        (None, True, 5, 0, 50, GAVE_UP),  # --max-requeues 5 reached
        (1, False, 0, 10, 50, REQUEUE),  # failed after progress: resume
        (1, False, 2, 50, 50, GAVE_UP),  # failed again with no new commit: it keeps crashing, stop the loop
        (1, False, 5, 10, 50, 1),  # failed at --max-requeues: stop, with the job's code
    ],
)
def test_the_requeue_decision(
    job_exit: int | None, preempted: bool, restarts: int, before: int, after: int, code: int
) -> None:
    outcome = decide(job_exit, preempted, restarts, 5, before, after)
    assert outcome.exit_code == code, outcome.reason
