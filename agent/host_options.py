"""The options of a host, as `elastic-agent` and `elasticctl local` (which starts agents) both take them: one
spelling, one environment variable, one help text and one default rule each (agent/gpus.py's `default_slots`);
and `AgentConfig`, what one agent is told of its host once they are read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from elastic_control_plane.agent.host_health import HealthSettings
from elastic_control_plane.job.assignments import MAX_SLOTS_PER_HOST


def host_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--slots`, `--share-gpus` and `--standby`, for a command that runs one agent or several on this machine."""
    for option in reversed(
        [
            click.option(
                "--slots",
                envvar="ELASTIC_SLOTS",
                type=click.IntRange(min=1, max=MAX_SLOTS_PER_HOST),
                default=None,
                help="Worker processes per agent (default: one per GPU, the machine's GPUs split among its agents; "
                "1 without GPUs).",
            ),
            click.option(
                "--share-gpus",
                envvar="ELASTIC_GPU_SHARED",
                is_flag=True,
                help="Allow more slots than GPUs: workers share GPUs (gloo, not NCCL, for CUDA tensors).",
            ),
            click.option(
                "--standby",
                envvar="ELASTIC_STANDBY_WORKERS",
                type=int,
                default=None,
                help="Spare worker processes per agent, kept waiting in init(); one takes a crashed worker's slot at "
                "once (default: 1 where the fork server runs, else 0).",
            ),
        ]
    ):
        fn = option(fn)
    return fn


@dataclass(frozen=True)
class AgentConfig:
    """One agent's host, as `elastic-agent` read it: its name, its slots and standbys (`--standby`; None: the
    default), the address its workers advertise, whether they share GPUs and may fork from a zygote, how long a drain
    waits for them, the run directory that holds its ipc socket, and its health checks (agent/host_health.py)."""

    host: str
    slots: int
    run_dir: Path
    advertise_address: str = "127.0.0.1"
    share_gpus: bool = False
    standby: int | None = None
    fork_server: bool = True
    drain_timeout: float = 60.0
    health: HealthSettings = HealthSettings()
