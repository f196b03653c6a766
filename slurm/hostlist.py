"""What Slurm's commands print, parsed: host lists (`node[01-03,7],gpu5`, as `scontrol show hostnames` expands
them), node states (`sinfo -N -o '%N|%T'`, `scontrol show node`'s State=) and the running jobs `squeue` lists.

Pure functions: the tests feed them output captured from a real Slurm 22.05 (tests/unit/test_slurm_parsing.py).
A line that cannot be read raises SlurmOutputError, never yields a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Node state words (sinfo %T, scontrol State=, case-insensitive; flags joined by '+'): Slurm will not run work on a
# node in any of these, so its agent is out of the job at once.
LOST_STATES = frozenset({"down", "fail", "failing", "future"})
DRAINED_STATES = frozenset({"drain", "drained", "draining"})
# sinfo's suffixes: * not responding, ~ powered off, # powering up, ! powering down, % powering down, $ maintenance
# reservation, @ pending reboot, ^ rebooting, - planned by backfill.
STATE_SUFFIXES = "*~#!%$@^-"
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class SlurmOutputError(ValueError):
    """Output of a Slurm command that is not what Slurm prints."""


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets; SlurmOutputError for unbalanced brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise SlurmOutputError(f"not a host list: {text!r} (nested brackets)")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SlurmOutputError(f"not a host list: {text!r} (']' without '[')")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmOutputError(f"not a host list: {text!r} ('[' without ']')")
    parts.append(text[start:])
    return parts


def _expand_ranges(body: str, whole: str) -> list[str]:
    """`01-03,7` -> ['01', '02', '03', '7']: zero-padded to the width of the range's first number, as Slurm pads."""
    numbers = []
    for term in body.split(","):
        match = _RANGE.match(term.strip())
        if not match:
            raise SlurmOutputError(f"not a host list: {whole!r} (range {term!r})")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise SlurmOutputError(f"not a host list: {whole!r} (range {term!r} runs backwards)")
        width = len(low) if low.startswith("0") else 0
        numbers += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return numbers


def _expand_one(pattern: str, whole: str) -> list[str]:
    """One host expression, brackets expanded left to right (`a-[1-2]-[3-4]`: a-1-3 a-1-4 a-2-3 a-2-4)."""
    open_at = pattern.find("[")
    if open_at < 0:
        return [pattern]
    close_at = pattern.index("]", open_at)
    head, body, tail = pattern[:open_at], pattern[open_at + 1 : close_at], pattern[close_at + 1 :]
    return [head + number + rest for number in _expand_ranges(body, whole) for rest in _expand_one(tail, whole)]


def expand_hostlist(text: str) -> list[str]:
    """The host names of a Slurm host list, in its order, each once (`scontrol show hostnames`)."""
    text = text.strip()
    if not text or text == "(null)":
        return []
    names: list[str] = []
    for pattern in _split_top(text):
        if not pattern or any(c.isspace() for c in pattern):
            raise SlurmOutputError(f"not a host list: {text!r}")
        names += [name for name in _expand_one(pattern, text) if name not in names]
    return names


@dataclass(frozen=True)
class NodeState:
    """A node as Slurm sees it: its state words (lower case, flags split), and whether its slurmd answers."""

    words: frozenset[str]
    responding: bool = True

    @classmethod
    def parse(cls, state: str) -> NodeState:
        """`idle`, `MIXED+DRAIN`, `down*`, `allocated+drain~`: what sinfo's %T or scontrol's State= print."""
        text = state.strip().lower()
        if not text or not re.fullmatch(r"[a-z_+]+[" + re.escape(STATE_SUFFIXES) + r"]*", text):
            raise SlurmOutputError(f"not a node state: {state!r}")
        suffixes = text[len(text.rstrip(STATE_SUFFIXES)) :]
        return cls(frozenset(text.rstrip(STATE_SUFFIXES).split("+")), "*" not in suffixes)

    @property
    def lost(self) -> bool:
        """Down or failed: its steps are ended by Slurm (with --no-kill the job goes on without it)."""
        return bool(self.words & LOST_STATES)

    @property
    def drained(self) -> bool:
        """Drained or draining: Slurm gives it no new work; its workers leave at their next commit."""
        return bool(self.words & DRAINED_STATES)


def parse_node_states(text: str) -> dict[str, NodeState]:
    """`sinfo -h -N -o '%N|%T'`: {node: state} (a node in several partitions is listed once per partition)."""
    states: dict[str, NodeState] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, sep, state = line.strip().partition("|")
        if not sep or not name:
            raise SlurmOutputError(f"not a 'node|state' line: {line!r}")
        states[name] = NodeState.parse(state)
    return states


def parse_scontrol_fields(text: str) -> dict[str, str]:
    """`scontrol show node X` / `show job X`: its Key=Value words (a value runs to the next space)."""
    fields = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


@dataclass(frozen=True)
class RunningJob:
    """One line of `squeue -h -t RUNNING -O SQUEUE_FIELDS`: the job id, the heterogeneous job it is a component of
    (its own id when none), its comment and the nodes it holds now."""

    job_id: str
    het_job_id: str
    comment: str
    nodes: tuple[str, ...]


SQUEUE_FIELDS = "JobID:|,HetJobID:|,Comment:|,NodeList:"


def parse_squeue(text: str) -> list[RunningJob]:
    """squeue's lines (`7|N/A|elastic-join=3|node[1-2]`, a het job's `4|3|(null)|node2`) as RunningJobs."""
    jobs = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.strip().split("|")
        if len(parts) < 4 or not parts[0].isdigit():
            raise SlurmOutputError(f"not a 'JobID|HetJobID|Comment|NodeList' line of squeue: {line!r}")
        job_id, het_job_id, nodes = parts[0], parts[1], parts[-1]
        comment = "|".join(parts[2:-1])
        jobs.append(
            RunningJob(
                job_id,
                het_job_id if het_job_id.isdigit() else job_id,
                "" if comment == "(null)" else comment,
                tuple(expand_hostlist(nodes)),
            )
        )
    return jobs


def join_comment(job_id: str) -> str:
    """The comment that marks an allocation as joining job `job_id` (`elasticctl slurm --join`)."""
    return f"elastic-join={job_id}"


def allocation_nodes(jobs: list[RunningJob], job_id: str) -> list[str]:
    """The nodes job `job_id` holds now: its own (every component of a heterogeneous job), then those of the
    allocations that joined it, each node once."""
    nodes: list[str] = []
    for job in sorted(jobs, key=lambda j: (j.het_job_id != job_id, int(j.job_id))):
        if job.het_job_id == job_id or job.comment == join_comment(job_id):
            nodes += [node for node in job.nodes if node not in nodes]
    return nodes
