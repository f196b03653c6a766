"""The job's options are the job spec's fields: `elasticctl run`, `local` and `torchrun` give every field of
job.spec.JobSpec (one entry each in elasticctl/options.py), with the spec's defaults, so a new field that has no
option, or an option that drifted from its field, fails here instead of silently falling back to a default."""

from __future__ import annotations

from dataclasses import replace

import click
import pytest

from elastic_control_plane.agent.main import main as agent_main
from elastic_control_plane.elasticctl.main import cli
from elastic_control_plane.elasticctl.options import FROM_OPTIONS, NOT_OPTIONS, _option_name, build_spec
from elastic_control_plane.job.spec import FIELDS, JobSpec


def test_every_field_of_the_spec_has_one_way_in_from_the_options() -> None:
    assert sorted(FROM_OPTIONS) == sorted(name for name in FIELDS if name not in NOT_OPTIONS)


@pytest.mark.parametrize("command", ["run", "local"])
def test_each_field_has_its_option_and_the_defaults_are_the_specs(command: str) -> None:
    params = cli.commands[command].params  # type: ignore[attr-defined]
    spelled = {option for param in params if isinstance(param, click.Option) for option in param.opts} | {"CMD"}
    for name in FROM_OPTIONS:
        assert _option_name(name).split()[0] in spelled, f"{name} has no option in `elasticctl {command}`"
    options = cli.commands[command].make_context(command, ["--", "python", "train.py"]).params  # type: ignore[attr-defined]
    spec = JobSpec.parse(build_spec(options))
    assert spec == JobSpec(command=["python", "train.py"])


def test_an_option_given_reaches_its_field() -> None:
    args = ["--min-np", "2", "--max-np", "3", "--hung-timeout", "90", "--env", "A=1", "--preload", "numpy,torch"]
    args += ["--no-fork-server", "--blacklist-cooldown", "1", "2", "--mode", "torchrun", "--", "python", "train.py"]
    options = cli.commands["run"].make_context("run", args).params  # type: ignore[attr-defined]
    assert JobSpec.parse(build_spec(options)) == replace(
        JobSpec(command=["python", "train.py"]),
        min_np=2,
        max_np=3,
        hung_timeout=90.0,
        env={"A": "1"},
        preload=["numpy", "torch"],
        fork_server=False,
        cooldown=(1.0, 2.0),
        mode="torchrun",
    )


def test_the_agent_and_elasticctl_local_take_a_hosts_options_alike() -> None:
    def host_params(command: click.Command) -> dict[str, tuple[object, ...]]:
        return {
            param.name: (param.opts, param.envvar, param.default, param.help)
            for param in command.params
            if isinstance(param, click.Option) and param.name in ("slots", "share_gpus", "standby")
        }

    assert host_params(agent_main) == host_params(cli.commands["local"])  # type: ignore[arg-type]
    assert len(host_params(agent_main)) == 3


def test_an_agent_offering_more_than_1024_slots_is_refused_before_it_starts() -> None:
    with pytest.raises(click.BadParameter, match="1<=x<=1024"):
        agent_main.make_context("elastic-agent", ["--host", "h", "--slots", "1025"])
