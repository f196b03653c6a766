"""`elasticctl slurm`: render the batch script of an elastic job (slurm/script.py) and submit it with sbatch, or
print it (--dry-run).

Its arguments are of three kinds, told apart here before click parses them: its own options (-N, --gpus-per-node,
--partition, --time, the control plane's placement, --join, --dry-run ...), the options of `elasticctl run` (the
job's: --min-np, --checkpoint-dir ...; handed to `elasticctl run` in the allocation as they were typed, after being
checked here) and any other option, which is sbatch's and goes on sbatch's command line unchanged; `--` then the
training command.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from elastic_control_plane.elasticctl.control import CommandError
from elastic_control_plane.elasticctl.options import build_spec, job_options
from elastic_control_plane.replication.etcd_member import etcd_binary
from elastic_control_plane.slurm import commands, job_end, resources, sbatch_options
from elastic_control_plane.slurm.hostlist import SlurmOutputError, expand_hostlist
from elastic_control_plane.slurm.script import (
    DEFAULT_MAX_REQUEUES,
    DEFAULT_SIGNAL_BEFORE,
    MIN_SIGNAL_BEFORE,
    SlurmJob,
    render,
    sbatch_argv,
)

OWN_OPTIONS = (
    "nodes",
    "gpus_per_node",
    "partition",
    "time",
    "control_hosts",
    "control",
    "join",
    "signal_before",
    "max_requeues",
    "state_dir",
    "dry_run",
)
JOIN_COMMAND = "(the joined job's)"
HOSTLIST_OPTIONS = ("-w", "--nodelist", "-x", "--exclude")  # sbatch's options whose value is a host list


def option_spans(command: click.Command, words: list[str]) -> Iterator[tuple[str | None, list[str]]]:
    """Each option typed, with the words it takes: (the name of `command`'s parameter, or None for an option it does
    not know, which is sbatch's and takes the next word when that is not an option: `-A acct`)."""
    params = {name: p for p in command.params if isinstance(p, click.Option) for name in p.opts + p.secondary_opts}
    i = 0
    while i < len(words):
        word = words[i]
        name = word.split("=", 1)[0]
        if not word.startswith("-"):
            raise CommandError(f"unexpected {word!r}: the training command goes after --", 2)
        if name not in params and not name.startswith("--") and len(name) > 2 and name[:2] in params:
            yield params[name[:2]].name, [word]  # -N3
            i += 1
            continue
        param = params.get(name)
        if param is None:
            count = 2 if "=" not in word and i + 1 < len(words) and not words[i + 1].startswith("-") else 1
        else:
            count = 1 if param.is_flag or param.count or "=" in word else 1 + param.nargs
        yield (param.name if param else None), words[i : i + count]
        i += count


def split_arguments(command: click.Command, args: list[str]) -> tuple[list[str], list[str], list[str], list[str]]:
    """(this command's own options, `elasticctl run`'s, sbatch's, the training command), each as typed."""
    if "--" not in args:
        if any(word == "--join" or word.startswith("--join=") for word in args):
            args = [*args, "--", JOIN_COMMAND]  # a joining allocation runs the job's command, not one of its own
        else:
            raise CommandError("missing `-- COMMAND`: elasticctl slurm -N 2 [options] -- python train.py", 2)
    cut = args.index("--")
    own: list[str] = []
    run: list[str] = []
    sbatch: list[str] = []
    for name, words in option_spans(command, args[:cut]):
        (sbatch if name is None else own if name in OWN_OPTIONS else run).extend(words)
    return own, run, sbatch, args[cut + 1 :]


def check_hostlists(sbatch: list[str]) -> None:
    """sbatch's host-list options must be host lists (`scontrol show hostnames node[1-` prints `node]`, exit 0)."""
    for i, word in enumerate(sbatch):
        name, sep, value = word.partition("=")
        if name in HOSTLIST_OPTIONS:
            value = value if sep else (sbatch[i + 1] if i + 1 < len(sbatch) else "")
            try:
                if not expand_hostlist(value):
                    raise SlurmOutputError(f"not a host list: {value!r}")
            except SlurmOutputError as exc:
                raise CommandError(f"{name}: {exc}", 2) from None


class SlurmCommand(click.Command):
    """Takes sbatch's options out of the arguments before click parses the rest (split_arguments)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if any(word in ("-h", "--help") for word in args[: args.index("--") if "--" in args else len(args)]):
            return super().parse_args(ctx, args)
        own, run, sbatch, training = split_arguments(self, list(args))
        ctx.meta["sbatch_options"], ctx.meta["run_flags"] = sbatch, run
        return super().parse_args(ctx, [*own, *run, "--", *training])


def absolute_checkpoint_dir(flags: list[str]) -> list[str]:
    """`elasticctl run`'s flags with --checkpoint-dir made absolute: the allocation may start elsewhere."""
    out = list(flags)
    for i, word in enumerate(out):
        if word == "--checkpoint-dir" and i + 1 < len(out):
            out[i + 1] = str(Path(out[i + 1]).resolve())
        elif word.startswith("--checkpoint-dir="):
            out[i] = "--checkpoint-dir=" + str(Path(word.split("=", 1)[1]).resolve())
    return out


def slurm_options(fn: Any) -> Any:
    options = [
        click.option("-N", "--nodes", type=click.IntRange(min=1), default=None, help="Nodes to allocate (sbatch -N)."),
        click.option(
            "--gpus-per-node", type=click.IntRange(min=1), default=None, help="GPUs per node: one worker each."
        ),
        click.option("-p", "--partition", default=None, help="Slurm partition (sbatch -p)."),
        click.option(
            "-t", "--time", default=None, help="Time limit (sbatch -t): a checkpoint and a requeue before it."
        ),
        click.option(
            "--control-hosts",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="1: the control plane on the batch host; N (odd, 3 or more): replicated on the first N nodes (etcd).",
        ),
        click.option(
            "--control",
            default=None,
            metavar="HOST[:PORT][,...]",
            help="A control plane outside the allocation (PORT: its first port, when not 5550).",
        ),
        click.option("--join", default=None, metavar="JOB", help="Add this allocation's nodes to running job JOB."),
        click.option(
            "--signal-before",
            type=click.IntRange(min=MIN_SIGNAL_BEFORE),
            default=DEFAULT_SIGNAL_BEFORE,
            show_default=True,
            metavar="S",
            help="Seconds before the time limit Slurm signals the job to checkpoint and requeue "
            f"(--signal=B:USR1@S); at least {MIN_SIGNAL_BEFORE}, the time the drain may take.",
        ),
        click.option("--max-requeues", type=click.IntRange(min=0), default=DEFAULT_MAX_REQUEUES, show_default=True),
        click.option(
            "--state-dir",
            envvar="ELASTIC_SLURM_DIR",
            type=click.Path(file_okay=False, path_type=Path),
            default=Path(".elastic-slurm"),
            show_default=True,
            help="Per job: its keys, its control plane's address and logs; on a file system every node shares.",
        ),
        click.option("--dry-run", is_flag=True, help="Print the batch script; submit nothing."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@click.command(
    "slurm",
    cls=SlurmCommand,
    context_settings={"ignore_unknown_options": True},
    help="Submit an elastic job to Slurm: elasticctl slurm -N 4 --gpus-per-node 8 [sbatch options] [run options] "
    "-- python train.py. Options elasticctl does not know are sbatch's, passed on unchanged.",
)
@slurm_options
@job_options
def slurm(**options: Any) -> None:
    ctx = click.get_current_context()
    sbatch, known = ctx.meta["sbatch_options"], ctx.meta["run_flags"]
    check_hostlists(sbatch)
    refused = sbatch_options.refusal(sbatch)
    if refused is not None:
        raise CommandError(refused, 2)
    wait = sbatch_options.waits(sbatch)  # elasticctl follows the job itself (slurm/job_end.py), requeues included
    sbatch = [word for word in sbatch if word not in sbatch_options.WAIT]
    share = gpu_share(options["gpus_per_node"], options["partition"], sbatch)
    build_spec(options)
    if options["nodes"] is None:
        raise CommandError("-N/--nodes is required", 2)
    check_control_hosts(options["control_hosts"], options["nodes"], options["control"], options["dry_run"])
    state_dir = options["state_dir"].resolve()
    job = SlurmJob(
        nodes=options["nodes"],
        command=list(options["command"]),
        state_dir=state_dir,
        python=sys.executable,
        run_flags=absolute_checkpoint_dir(known),
        sbatch_options=sbatch,
        gpus_per_node=options["gpus_per_node"],
        resources=resources.resource_lines(options["gpus_per_node"], sbatch, share),
        partition=options["partition"],
        time=options["time"],
        control_hosts=options["control_hosts"],
        control=options["control"],
        join=options["join"],
        signal_before=options["signal_before"],
        max_requeues=options["max_requeues"],
    )
    if job.join is not None and not options["dry_run"]:
        job = replace(job, exclude=joined_nodes(job.join, state_dir))
    if options["dry_run"]:
        click.echo(render(job), nl=False)
        return
    submitted = state_dir / "submitted"
    submitted.mkdir(mode=0o700, parents=True, exist_ok=True)
    script = submitted / f"elastic-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.sh"
    script.write_text(render(job))
    try:
        job_id = commands.run(sbatch_argv(job, script)).strip().split(";")[0]
    except commands.SlurmError as exc:
        raise CommandError(str(exc), 2 if "not installed" in str(exc) else 1) from None
    click.echo(f"submitted batch job {job_id} (script {script})")
    if wait:
        sys.exit(job_end.follow(job_id, lambda line: click.echo(line, err=True)))


def gpu_share(gpus_per_node: int | None, partition: str | None, sbatch: list[str]) -> tuple[int, int] | None:
    """Each GPU's share of its node's CPUs and memory, for a GPU job whose user asked neither (slurm/resources.py);
    None, said in one line, when Slurm cannot tell it."""
    if gpus_per_node is None or (
        resources.user_gave(sbatch, resources.CPU_OPTIONS) and resources.user_gave(sbatch, resources.MEMORY_OPTIONS)
    ):
        return None
    try:
        share = resources.share_per_gpu(commands.node_shapes(partition), gpus_per_node)
        why = f"no node{' of partition ' + partition if partition else ''} has {gpus_per_node} GPUs"
    except commands.SlurmError as exc:
        share, why = None, f"cannot read the nodes' CPUs and memory ({exc})"
    if share is None:
        click.echo(
            f"elasticctl slurm: {why}: the job asks Slurm's defaults for CPUs and memory (one CPU per node where the "
            "site sets no DefCpuPerGPU); give --cpus-per-gpu and --mem-per-gpu",
            err=True,
        )
    return share


def check_control_hosts(count: int, nodes: int, control: str | None, dry_run: bool) -> None:
    """CommandError (exit 2) unless `count` control hosts can be placed: 1, or an odd number from 3 to `nodes` (etcd
    keeps a majority of them), without --control, with etcd installed (checked when the job is submitted)."""
    if count == 1:
        return
    if control is not None:
        raise CommandError(
            f"--control-hosts {count} and --control: give one (--control names a control plane outside the allocation)",
            2,
        )
    if count < 3 or count % 2 == 0:
        raise CommandError(
            f"--control-hosts {count}: a replicated control plane needs an odd number of control hosts, 3 or more "
            "(etcd keeps a majority of them)",
            2,
        )
    if count > nodes:
        raise CommandError(f"--control-hosts {count}: more than the job's {nodes} node(s) (-N)", 2)
    if not dry_run:
        try:
            etcd_binary()
        except FileNotFoundError as exc:
            raise CommandError(f"--control-hosts {count}: {exc}", 2) from None


def joined_nodes(job_id: str, state_dir: Path) -> str:
    """The nodes of JOB, which the joining allocation must not take again (their agents run); CommandError (exit 2)
    unless JOB runs and was submitted by elasticctl slurm with this state directory."""
    try:
        fields = commands.job_fields(job_id)
    except commands.SlurmError as exc:
        raise CommandError(f"--join {job_id}: {exc}", 2) from None
    if fields.get("JobState") not in ("RUNNING", "PENDING", "CONFIGURING"):
        raise CommandError(f"--join {job_id}: the job is {fields.get('JobState', 'unknown').lower()}, not running", 2)
    if not (state_dir / job_id / "control").exists():
        raise CommandError(f"--join {job_id}: no control plane of that job in {state_dir} (--state-dir)", 2)
    return fields.get("NodeList", "")
