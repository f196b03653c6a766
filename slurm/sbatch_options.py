"""Which of sbatch's own options a user may give `elasticctl slurm` (they go on sbatch's command line, where they win
over the batch script's lines): the ones that would switch the job's protocol off are refused, one line each, naming
the option and what to use instead; sbatch's `--wait` is noticed, since elasticctl then waits with sbatch.

The protocol they would break (slurm/script.py): `--signal=B:USR1@S` tells the batch shell to checkpoint and requeue
before the limit or a preemption, `--requeue` lets it run again, `--open-mode=append` keeps one output across its
runs, and one driver per allocation starts one agent per node, each with one worker per GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

# sbatch's option (long, short) -> why it is refused and what to use instead.
REFUSED = {
    ("--signal", None): "elasticctl slurm sets --signal=B:USR1@S itself (the checkpoint and the requeue); use "
    "--signal-before S",
    ("--no-requeue", None): "the job requeues itself after a checkpoint (a preemption, the time limit); use "
    "--max-requeues 0 for a job that never runs again",
    ("--ntasks", "-n"): "the allocation runs one agent per node, which starts one worker per GPU; use "
    "--gpus-per-node (and -N for the nodes)",
    ("--ntasks-per-node", None): "the allocation runs one agent per node, which starts one worker per GPU; use "
    "--gpus-per-node",
    ("--ntasks-per-gpu", None): "the allocation runs one agent per node, which starts one worker per GPU; use "
    "--gpus-per-node",
}
OUTPUTS = (("--output", "-o"), ("--error", "-e"))  # allowed only with --open-mode=append: a requeue truncates them
WAIT = ("--wait", "-W")


def given(sbatch: list[str]) -> Iterator[tuple[str, str | None]]:
    """Each option of `sbatch` (as typed: `--name=value`, `--name value`, `-x value` or `-xvalue`) as (its name, its
    value if attached with '='): values that follow as a word of their own are skipped as options."""
    for word in sbatch:
        if word.startswith("--"):
            name, sep, value = word.partition("=")
            yield name, value if sep else None
        elif word.startswith("-") and len(word) >= 2:
            yield word[:2], None


def refusal(sbatch: list[str]) -> str | None:
    """Why one of the user's sbatch options may not be given, in one line; None when all may."""
    options = dict(given(sbatch))
    for (long, short), why in REFUSED.items():
        for name in (long, short):
            if name is not None and name in options:
                return f"sbatch's {name}: {why}"
    append = options.get("--open-mode") == "append"
    if "--open-mode" in options and not append:
        return "sbatch's --open-mode: a requeued run must add to the job's output, not replace it (--open-mode=append)"
    for long, short in OUTPUTS:
        for name in (long, short):
            if name in options and not append:
                return (
                    f"sbatch's {name} without --open-mode=append: each requeued run would truncate what the runs "
                    "before it wrote; add --open-mode=append"
                )
    return None


def waits(sbatch: list[str]) -> bool:
    """Did the user ask sbatch to wait for the job to end (`--wait`, `-W`)?"""
    return any(name in WAIT for name, _ in given(sbatch))
