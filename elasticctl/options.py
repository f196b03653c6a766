"""The options of a job (`elasticctl run` and `local`) and the spec they make: defaults and rules from job.spec.

Each option's default is the job spec's; `build_spec` turns the options into
the spec the registry is sent, one entry of FROM_OPTIONS per field of the spec
(tests/unit/test_cli_options.py checks that every field has its entry and its
option), and checks it with `JobSpec.parse` first, so a broken rule is one
line naming the option (the same rule the registry applies).
What only this machine can tell (a --checkpoint-dir that is not writable) and
the options' own syntax (--env KEY=VALUE, --preload A,B) are checked here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from elastic_control_plane.elasticctl.control import CommandError
from elastic_control_plane.job.spec import FIELDS, MODES, JobSpec, SpecError
from elastic_control_plane.snapshot.durable import untrusted_directory

# How the CLI spells a spec's field in an error; any other field is its option, `--` and the name with dashes.
SPELLED = {
    "command": "CMD",
    "cooldown": "--blacklist-cooldown MIN MAX",
    "env": "--env",
    "fork_server": "--no-fork-server",
    "hang_detection": "--no-hang-detection",
}


def _option_name(field: str) -> str:
    return SPELLED.get(field, "--" + field.replace("_", "-"))


def _spec_option(name: str, kind: Any, help_text: str, field: str = "", **extra: Any) -> Any:
    """An option whose default (shown in --help) is the job spec's `field` (by default the option's own name)."""
    field = field or name.removeprefix("--").replace("-", "_")
    return click.option(name, type=kind, default=getattr(JobSpec, field), show_default=True, help=help_text, **extra)


def job_options(fn: Any) -> Any:
    for option in reversed(
        [
            _spec_option("--min-np", int, "Fewest workers to train with; below it the job waits."),
            _spec_option("--max-np", int, "Most workers to use (default: every slot)."),
            _spec_option("--reset-limit", int, "Stop after this many resets."),
            _spec_option("--elastic-timeout", float, "Seconds to wait for --min-np slots."),
            click.option(
                "--discovery-script",
                type=click.Path(exists=True, dir_okay=False, resolve_path=True),
                default=None,
                help="Prints 'host' or 'host:slots' lines.",
            ),
            _spec_option(
                "--blacklist-cooldown",
                (float, float),
                "Blacklisted hosts return after a cooldown in this range (exponential backoff).",
                field="cooldown",
                metavar="MIN MAX",
            ),
            _spec_option(
                "--probation-clean",
                float,
                "Seconds a blacklisted host must run clean after its return before its failures are forgotten (its "
                "next cooldown starts again from MIN); each failure before that doubles the cooldown.",
            ),
            _spec_option(
                "--hung-timeout",
                float,
                "Upper bound, in seconds, on how long the others wait for a rank before it counts as hung (the limit "
                "calibrates itself below it: a rank whose process tree makes no progress is suspected at 30 s or "
                "more and killed at 4/3 of that; a rank that declares a wait with libworker.elastic.waiting(reason, "
                "up_to=S) is not judged inside it), and on how long workers may stay silent after a round's first "
                "report.",
            ),
            _spec_option(
                "--max-restarts",
                int,
                "Restarts in place of a crashed worker's slot within --restart-window; one more crash blacklists "
                "its host (0: Horovod's rule, the first crash does).",
            ),
            _spec_option("--restart-window", float, "Seconds over which a slot's crashes count toward --max-restarts."),
            click.option(
                "--checkpoint-dir",
                type=click.Path(file_okay=False, path_type=Path),
                default=None,
                help="Agents flush the newest host snapshot here in the background (atomic, checksummed, the last two "
                "kept); a job started on it resumes from the newest checkpoint. Must be reachable at the same "
                "path on every host.",
            ),
            _spec_option("--checkpoint-interval", float, "Seconds between flushes to --checkpoint-dir."),
            _spec_option(
                "--mode",
                click.Choice(MODES),
                "horovod: the command joins rounds through libworker (Horovod Elastic); torchrun: an unchanged "
                "torchrun/DDP script, started with torchrun's environment and restarted on every worker at each "
                "new round.",
            ),
            click.option(
                "--preload",
                metavar="MODULE,...",
                default="",
                help="Modules the host's fork server imports before it forks workers (the script's heavy imports).",
            ),
            click.option(
                "--no-fork-server",
                is_flag=True,
                help="Spawn every worker as a fresh interpreter instead of forking it from its host's fork server "
                "(for scripts that are not fork-safe).",
            ),
            click.option(
                "--no-hang-detection",
                is_flag=True,
                help="Do not look for hung workers by how long the others wait for them (only --hung-timeout "
                "applies) and do not measure what each rank costs the others.",
            ),
            click.option(
                "--env", "env_pairs", multiple=True, metavar="KEY=VALUE", help="Extra environment for the workers."
            ),
            click.argument("command", nargs=-1, required=True),
        ]
    ):
        fn = option(fn)
    return fn


def _env(options: dict[str, Any]) -> dict[str, str]:
    env = {}
    for pair in options["env_pairs"]:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CommandError(f"--env wants KEY=VALUE, got {pair!r}", 2)
        env[key] = value
    return env


def _checkpoint_dir(options: dict[str, Any]) -> str | None:
    checkpoint_dir = options["checkpoint_dir"]
    if checkpoint_dir is None:
        return None
    if checkpoint_dir.exists() and not os.access(checkpoint_dir, os.W_OK):
        raise CommandError(f"--checkpoint-dir {checkpoint_dir} is not writable", 2)
    untrusted = untrusted_directory(checkpoint_dir)
    if untrusted is not None:
        raise CommandError(f"--checkpoint-dir {checkpoint_dir}: {untrusted}", 2)
    return str(checkpoint_dir.resolve())


# Each field of the job spec, as the options give it; `cwd` is where the command is typed (elasticctl/follow.py).
FROM_OPTIONS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "command": lambda options: list(options["command"]),
    "cooldown": lambda options: list(options["blacklist_cooldown"]),
    "checkpoint_dir": _checkpoint_dir,
    "env": _env,
    "preload": lambda options: [name.strip() for name in options.get("preload", "").split(",") if name.strip()],
    "fork_server": lambda options: not options.get("no_fork_server", False),
    "hang_detection": lambda options: not options.get("no_hang_detection", False),
    **{
        name: (lambda options, name=name: options[name])
        for name in (
            "min_np",
            "max_np",
            "reset_limit",
            "elastic_timeout",
            "discovery_script",
            "hung_timeout",
            "max_restarts",
            "restart_window",
            "checkpoint_interval",
            "mode",
            "probation_clean",
        )
    },
}
NOT_OPTIONS = ("cwd",)


def build_spec(options: dict[str, Any]) -> dict[str, Any]:
    """The spec the registry is sent, checked by the job spec's rules; CommandError (exit 2) names the option."""
    spec = {name: FROM_OPTIONS[name](options) for name in FIELDS if name not in NOT_OPTIONS}
    try:
        JobSpec.parse(spec)
    except SpecError as exc:
        raise CommandError(exc.named({name: _option_name(name) for name in exc.names}), 2) from None
    return spec
