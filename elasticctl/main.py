"""The `elasticctl` command: click commands, each ending in an exit code; every error is one line."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from elastic_control_plane.agent.host_options import host_options
from elastic_control_plane.bus.config import (
    ConfigError,
    Endpoints,
    endpoint_host,
    endpoint_list,
    is_loopback,
    unresolved_hosts,
)
from elastic_control_plane.bus.roles import AGENT, OPERATOR
from elastic_control_plane.bus.sockets import SERVER_KEY, SHARES_DIR, SecurityError, generate_keys, role_keys
from elastic_control_plane.elasticctl.control import CommandError, ControlPlane, ControlPlaneUnreachable
from elastic_control_plane.elasticctl.control_hosts import gather_control_hosts, gather_corrupt_records
from elastic_control_plane.elasticctl.events import follow_events, print_history
from elastic_control_plane.elasticctl.follow import CANCEL_WAIT, submit_and_follow
from elastic_control_plane.elasticctl.local import run_local
from elastic_control_plane.elasticctl.local_keys import live_local_keys
from elastic_control_plane.elasticctl.options import build_spec, job_options
from elastic_control_plane.elasticctl.report import as_json as report_json
from elastic_control_plane.elasticctl.report import gather as gather_report
from elastic_control_plane.elasticctl.report import render as render_report
from elastic_control_plane.elasticctl.slurm import slurm
from elastic_control_plane.elasticctl.status import as_json, gather, render, render_control_plane
from elastic_control_plane.elasticctl.torchrun import LaunchError, parse_launch
from elastic_control_plane.elasticctl.watch import watch_status
from elastic_control_plane.replication.etcd_tls import DEFAULT_HOSTS, make_etcd_certs
from elastic_control_plane.replication.store_choice import StoreChoice

keys_option = click.option(
    "--keys",
    envvar="ELASTIC_KEYS",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="CURVE key directory (default: none; on loopback, the keys of your running elasticctl local).",
)
control_option = click.option(
    "--control",
    envvar="ELASTIC_CONTROL",
    default=None,
    help="Host(s) of the control plane, comma-separated for a replicated control plane (default 127.0.0.1).",
)


def _plane(control: str | None, keys: Path | None) -> ControlPlane:
    """Clients of the control plane; a bad endpoint (ConfigError) or a host that does not resolve ends the command."""
    from_env = click.get_current_context().get_parameter_source("control") is ParameterSource.ENVIRONMENT
    endpoints = Endpoints.from_env(control, "ELASTIC_CONTROL" if from_env else "--control")
    unresolved = unresolved_hosts(endpoints.values())
    if unresolved:
        raise CommandError(f"cannot reach the control plane: {', '.join(unresolved)} does not resolve")
    on_loopback = all(
        is_loopback(endpoint_host(address) or "") for value in endpoints.values() for address in endpoint_list(value)
    )
    return ControlPlane(endpoints, keys if keys is not None or not on_loopback else live_local_keys())


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Operate elastic training jobs."""


@cli.command(
    help=(
        "Submit a job and follow it; exit with the job's exit code.\n\n"
        "While following, an outage of the control plane is ridden through: one line when it stops answering, "
        "retries (0.25 s doubling to 2 s), one line when it answers again. Ctrl-C cancels the job as soon as the "
        f"registry answers; if it does not answer within {CANCEL_WAIT:g}s (or on a second Ctrl-C), elasticctl "
        "exits 130 "
        "and the job may still be running. No control plane at submit time: one error line, exit 1."
    )
)
@control_option
@keys_option
@click.option(
    "--attach",
    "run_id",
    default=None,
    metavar="RUN",
    help="Name this submission RUN: if the registry's job is already RUN (a submitter started again: a Kubernetes "
    "Job's new pod), follow it, running or ended, instead of submitting it again.",
)
@job_options
def run(control: str | None, keys: Path | None, run_id: str | None, **options: Any) -> None:
    spec = build_spec(options)
    plane = _plane(control, keys)
    try:
        sys.exit(submit_and_follow(plane, spec, run_id))
    finally:
        plane.close()


@cli.command()
@control_option
@keys_option
@click.option(
    "--json",
    "as_json_flag",
    is_flag=True,
    help="Stable JSON for scripts (with --watch: one document per line per interval).",
)
@click.option(
    "--watch",
    is_flag=True,
    help="Redraw every --interval seconds until Ctrl-C (exit 0); once it has started, an outage shows 'control plane "
    "unreachable, retrying' instead of ending it.",
)
@click.option(
    "--interval", type=float, default=None, metavar="S", help="Seconds between redraws with --watch (default 1)."
)
@click.option(
    "--store",
    envvar="ELASTIC_STORE",
    default="sqlite",
    metavar="etcd://H:P,H:P,H:P[/PREFIX]",
    help="With a replicated control plane: its etcd, to show every control host (etcd member, each service's "
    "replica: active or standby).",
)
def status(
    control: str | None, keys: Path | None, as_json_flag: bool, watch: bool, interval: float | None, store: str
) -> None:
    """Show the job, its hosts and its workers (and, with --store etcd://..., the control hosts)."""
    from_env = click.get_current_context().get_parameter_source("store") is ParameterSource.ENVIRONMENT
    try:
        choice = StoreChoice.parse("ELASTIC_STORE" if from_env else "--store", store)
    except ConfigError as exc:
        raise CommandError(str(exc), 2) from None
    if interval is not None and not watch:
        raise CommandError("--interval needs --watch", 2)
    interval = 1.0 if interval is None else interval
    if not (math.isfinite(interval) and interval > 0):
        raise CommandError(f"--interval must be a positive number of seconds (got {interval:g})", 2)
    plane = _plane(control, keys)
    choice = choice.with_keys(plane.keys_dir)
    try:
        if watch:
            sys.exit(watch_status(plane, interval, as_json_flag))
        view = gather(plane)
    except ControlPlaneUnreachable:
        if choice.kind != "etcd":
            raise
        # What etcd knows may say why: the control hosts, and a record that keeps a service from starting.
        control_plane = {
            "control_hosts": gather_control_hosts(choice),
            "corrupt_records": gather_corrupt_records(choice),
        }
        click.echo(as_json(control_plane) if as_json_flag else render_control_plane(control_plane))
        raise
    finally:
        plane.close()
    if choice.kind == "etcd":
        view["control_hosts"] = gather_control_hosts(choice)
        view["corrupt_records"] = gather_corrupt_records(choice)
    click.echo(as_json(view) if as_json_flag else render(view, time.time()))


@cli.command()
@control_option
@keys_option
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="After the history, print new events until Ctrl-C (exit 0); once it has started, a notifier outage is one "
    "line, not the end.",
)
@click.option(
    "--since",
    type=int,
    default=0,
    show_default=True,
    metavar="SEQ",
    help="Only events after sequence number SEQ (0: all the notifier still holds).",
)
def events(control: str | None, keys: Path | None, follow: bool, since: int) -> None:
    """Print the notifier's events, one line each: time, seq, type, what happened (heartbeats left out)."""
    if since < 0:
        raise CommandError(f"--since must be at least 0 (got {since})", 2)
    plane = _plane(control, keys)
    try:
        if follow:
            sys.exit(follow_events(plane, since))
        print_history(plane, since)
    finally:
        plane.close()


@cli.command()
@control_option
@keys_option
@click.argument("job", type=int)
@click.option("--json", "as_json_flag", is_flag=True, help="The whole ledger as stable JSON.")
def report(control: str | None, keys: Path | None, job: int, as_json_flag: bool) -> None:
    """Where job JOB's wall clock went (its goodput ledger): each bucket, each cause and host, each interruption."""
    plane = _plane(control, keys)
    try:
        reply = gather_report(plane, job)
    finally:
        plane.close()
    click.echo(report_json(reply) if as_json_flag else render_report(reply))


def _host_command(name: str, description: str, past: str) -> None:
    @cli.command(name=name, help=description)
    @control_option
    @keys_option
    @click.argument("host")
    def command(control: str | None, keys: Path | None, host: str) -> None:
        plane = _plane(control, keys)
        try:
            reply = plane.call("discovery", name, {"host": host})
        finally:
            plane.close()
        click.echo(f"{host}: {past} ({reply['state']})")


_host_command("drain", "Take HOST out gracefully: its workers leave at their next commit (no rollback).", "draining")
_host_command("undrain", "Put HOST back into the job from the next round.", "undrained")
_host_command(
    "uncordon",
    "Clear HOST's blacklist, cooldown and failure count; it enters the job again once a fresh health check passes.",
    "uncordoned",
)


@cli.command()
@click.option(
    "--hosts", type=click.IntRange(min=1), default=2, show_default=True, help="Agents to start, named host-1..N."
)
@host_options
@click.option(
    "--control-hosts",
    type=click.IntRange(min=1, max=9),
    default=1,
    show_default=True,
    help="Control hosts: more than 1 replicates the control plane over etcd, control host i on 127.0.0.i (one etcd "
    "member and one replica of each service each); none is restarted when it dies.",
)
@job_options
def local(
    hosts: int, slots: int | None, share_gpus: bool, standby: int | None, control_hosts: int, **options: Any
) -> None:
    """Run the whole system on this machine (services + agents on loopback) for one job."""
    spec = build_spec(options)
    sys.exit(run_local(hosts, slots, spec, share_gpus, standby, control_hosts))


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False, "help_option_names": []},
    help=(
        "torchrun's launch line as a torchrun-mode job: change `torchrun` to `elasticctl torchrun`. Supported: "
        "--nnodes N|MIN:MAX, --nproc-per-node N, --max-restarts K, --rdzv-endpoint HOST[:PORT] (the control plane's "
        "host; without it the whole system runs here, as `elasticctl local`), --rdzv-backend c10d|static, --rdzv-id, "
        "--rdzv-conf, --standalone, --monitor-interval, -m/--module, --no-python; any other flag is refused."
    ),
)
@keys_option
@click.argument("launch", nargs=-1, type=click.UNPROCESSED)
def torchrun(keys: Path | None, launch: tuple[str, ...]) -> None:
    try:
        parsed = parse_launch(list(launch))
    except LaunchError as exc:
        raise CommandError(str(exc), 2) from None
    defaults = run.make_context("run", ["--", *parsed.command]).params
    spec = build_spec(
        {
            **defaults,
            "command": parsed.command,
            "min_np": parsed.min_np,
            "max_np": parsed.max_np,
            "reset_limit": parsed.max_restarts,
            "mode": "torchrun",
        }
    )
    if parsed.control_host is None:
        sys.exit(run_local(parsed.max_nodes, parsed.nproc_per_node, spec))
    plane = _plane(parsed.control_host, keys)
    try:
        sys.exit(submit_and_follow(plane, spec))
    finally:
        plane.close()


@cli.group()
def keys() -> None:
    """CURVE keys and etcd certificates for the control plane."""


@keys.command("generate")
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False))
@click.option(
    "--etcd-host",
    "etcd_hosts",
    multiple=True,
    metavar="HOST",
    help="A name or address of an etcd member, for its certificate (repeat; default: localhost, 127.0.0.1).",
)
@click.option(
    "--agent-host",
    "agent_hosts",
    multiple=True,
    metavar="HOST",
    help="Give this host's agent a key of its own, which may speak only for it (repeat; default: one key all agents "
    "share). Each host then gets DIRECTORY without the other hosts' agents/HOST.key_secret.",
)
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the keys DIRECTORY holds already (a container that makes keys on its first start, started again, must "
    "not replace the keys the agents hold); make them only where there are none.",
)
@click.option(
    "--shares",
    is_flag=True,
    help="Also write each role's share, what to hand agents and operators instead of DIRECTORY: "
    "DIRECTORY/shares/agent and DIRECTORY/shares/operator (elasticctl keys share).",
)
def keys_generate(
    directory: Path, etcd_hosts: tuple[str, ...], agent_hosts: tuple[str, ...], keep: bool, shares: bool
) -> None:
    """Write server and client keypairs to DIRECTORY (secrets 0600), authorise the client key, and make etcd's CA and
    its members' and clients' certificates in DIRECTORY/etcd."""
    if keep and (directory / f"{SERVER_KEY}.key_secret").exists():
        click.echo(f"keys kept in {directory}")
    else:
        try:
            generate_keys(directory, agent_hosts)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        make_etcd_certs(directory, etcd_hosts or DEFAULT_HOSTS)
        click.echo(f"keys written to {directory} (hand agents and operators their share: elasticctl keys share)")
    if shares:
        for role in (AGENT, OPERATOR):
            role_keys(directory, role, directory / SHARES_DIR / role)
        click.echo(f"shares written to {directory / SHARES_DIR}: agent/ for agents, operator/ for elasticctl")


@keys.command("share")
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.argument("target", type=click.Path(path_type=Path, file_okay=False))
@click.option(
    "--role",
    type=click.Choice([AGENT, OPERATOR]),
    required=True,
    help="Whose share: an agent's (its keypair and the server's public key) or an operator's (elasticctl's).",
)
def keys_share(directory: Path, target: Path, role: str) -> None:
    """Write to TARGET what a ROLE needs of DIRECTORY and nothing more (an agent never gets the server's secret, the
    operator's keypair or etcd's CA): hand each host TARGET instead of DIRECTORY."""
    try:
        role_keys(directory, role, target)
    except OSError as exc:
        raise CommandError(f"cannot share {directory}: {exc}", 2) from None
    click.echo(f"{role} keys written to {target} (give them with --keys {target})")


cli.add_command(slurm)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except CommandError as exc:
        click.echo(f"elasticctl: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.UsageError as exc:
        click.echo(f"elasticctl: {exc.format_message()}", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        click.echo(f"elasticctl: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        click.echo("elasticctl: interrupted", err=True)
        sys.exit(130)
    except ConfigError as exc:
        click.echo(f"elasticctl: {exc}", err=True)
        sys.exit(2)
    except (SecurityError, OSError) as exc:
        click.echo(f"elasticctl: {exc}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
