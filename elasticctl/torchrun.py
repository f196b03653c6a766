"""`elasticctl torchrun`: torchrun's launch line, read as torchrun reads it, turned into a torchrun-mode job.

A launch line ports by changing its first word: `torchrun --nnodes 1:4 --nproc-per-node 8 --max-restarts 3
--rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py ARGS` becomes `elasticctl torchrun ...` with the same
flags. Flags are spelled with dashes or underscores, as `--flag value` or `--flag=value`; the first word that is
not a flag is the script, and everything after it is the script's.

What the flags mean here:
- `--nnodes N` or `MIN:MAX`: the job trains on MIN to MAX hosts (`--min-np`/`--max-np` of MIN and MAX times
  `--nproc-per-node`); `--nproc-per-node N`: workers per host;
- `--max-restarts K`: the job's reset limit; as torchrun's, it counts the restarts after a failure (not those after
  a change of hosts), and the job fails when a failure would need a K+1-th (torchrun's default, 0, included);
- `--rdzv-endpoint HOST[:PORT]`: the job goes to the control plane on HOST (its own ports, ELASTIC_*_ENDPOINT;
  PORT is torchrun's and is not used), whose agents must have been started with `--slots` of the
  `--nproc-per-node`; without it (or with `--standalone`) the whole system runs on this machine for the job, with
  MAX hosts of `--nproc-per-node` slots, as `elasticctl local` does;
- `--rdzv-backend` (c10d or static), `--rdzv-id`, `--rdzv-conf`, `--monitor-interval`, `--max-nodes`... of that kind
  are accepted where they change nothing here (listed in ACCEPTED); `-m`/`--module` and `--no-python` start the
  command as torchrun does;
- any other flag is refused with one line, never ignored.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

WITH_VALUE = {
    "nnodes",
    "nproc_per_node",
    "max_restarts",
    "rdzv_endpoint",
    "rdzv_backend",
    "rdzv_id",
    "rdzv_conf",
    "monitor_interval",
}
FLAGS = {"standalone", "module", "no_python"}
ACCEPTED = ("rdzv_backend", "rdzv_id", "rdzv_conf", "monitor_interval")
SHORT = {"-m": "module"}
SUPPORTED = (
    "--nnodes, --nproc-per-node, --max-restarts, --rdzv-endpoint, --rdzv-backend, --rdzv-id, --rdzv-conf, "
    "--standalone, --monitor-interval, -m/--module, --no-python"
)


class LaunchError(ValueError):
    """A launch line this command does not run (one line, for the user)."""


@dataclass(frozen=True)
class TorchrunLaunch:
    command: list[str]
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    control_host: str | None  # None: run the whole system locally

    @property
    def min_np(self) -> int:
        return self.min_nodes * self.nproc_per_node

    @property
    def max_np(self) -> int:
        return self.max_nodes * self.nproc_per_node


def parse_launch(argv: list[str], python: str = sys.executable) -> TorchrunLaunch:
    options: dict[str, str | bool] = {}
    rest = list(argv)
    while rest and rest[0].startswith("-") and rest[0] != "--":
        word = rest.pop(0)
        name, has_value, value = (SHORT.get(word, word.lstrip("-"))).partition("=")
        name = name.replace("-", "_")
        if name in FLAGS and not has_value:
            options[name] = True
        elif name in WITH_VALUE:
            if not has_value:
                if not rest:
                    raise LaunchError(f"--{name.replace('_', '-')} needs a value")
                value = rest.pop(0)
            options[name] = value
        else:
            raise LaunchError(
                f"{word.partition('=')[0]} is not supported by elasticctl torchrun (supported: {SUPPORTED})"
            )
    if rest[:1] == ["--"]:
        rest.pop(0)
    if not rest:
        raise LaunchError("missing the script: elasticctl torchrun [FLAGS] script.py [ARGS]")
    min_nodes, max_nodes = _nodes(str(options.get("nnodes", "1")))
    nproc = _positive("--nproc-per-node", str(options.get("nproc_per_node", "1")))
    max_restarts = _count("--max-restarts", str(options.get("max_restarts", "0")))
    backend = str(options.get("rdzv_backend", "c10d"))
    if backend not in ("c10d", "static"):
        raise LaunchError(
            f"--rdzv-backend {backend} is not supported (c10d or static: the control plane is the rendezvous)"
        )
    endpoint = options.get("rdzv_endpoint")
    control_host = None if options.get("standalone") or not endpoint else _host_of(str(endpoint))
    if options.get("no_python"):
        command = rest
    elif options.get("module"):
        command = [python, "-m", *rest]
    else:
        command = [python, *rest]
    return TorchrunLaunch(command, min_nodes, max_nodes, nproc, max_restarts, control_host)


def _nodes(value: str) -> tuple[int, int]:
    low, sep, high = value.partition(":")
    min_nodes = _positive("--nnodes", low)
    max_nodes = _positive("--nnodes", high) if sep else min_nodes
    if max_nodes < min_nodes:
        raise LaunchError(f"--nnodes {value}: MIN must not exceed MAX")
    return min_nodes, max_nodes


def _positive(flag: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise LaunchError(f"{flag} wants a whole number of at least 1, got {value!r}")
    return int(value)


def _count(flag: str, value: str) -> int:
    if not value.isdigit():
        raise LaunchError(f"{flag} wants a whole number of at least 0, got {value!r}")
    return int(value)


def _host_of(endpoint: str) -> str:
    """HOST of HOST, HOST:PORT, [IPv6] or [IPv6]:PORT."""
    if endpoint.startswith("["):
        host = endpoint[1 : endpoint.find("]")]
    else:
        host = endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 else endpoint
    if not host:
        raise LaunchError(f"--rdzv-endpoint {endpoint!r} names no host")
    return host
