"""Discovery from Slurm: a thread that asks Slurm, every POLL seconds, which nodes the job holds now and what state
each is in, and keeps the host list discovery takes (services/discovery/service.py takes it as it takes the
Kubernetes pods').

The hosts are the nodes of the job (`--slurm-job JOB`, ELASTIC_SLURM_JOB, set by the batch script's driver): of
every component of a heterogeneous job, and of every running allocation that joined it (`elasticctl slurm --join
JOB` marks its allocation with the comment `elastic-join=JOB`), less the nodes Slurm marks DOWN, FAIL or DRAIN
(`sinfo -N`): such a node leaves the job at the next poll, without waiting for its agent's heartbeats to stop, and
one the job held that Slurm marks DOWN or FAIL (`lost`: Slurm ended its steps, and with `--no-kill` took it out of
the allocation) is a lost host at once, as if its heartbeats had stopped (a drained node's workers leave at their
next commit; a node whose allocation ended, a joined one, leaves as its agent does). A host is used only when its
agent is up as well. A node that is not responding (`*`) stays: its agent's
heartbeats say whether it is gone (Slurm takes 15-20 s to mark a dead slurmd DOWN, and the agent may still run).

A requeued job's driver hands discovery the hosts the job gave up on before (`excluded`, excluded from this
allocation by Slurm): they are only said, in discovery's `hosts` replies, for `elasticctl status`.

Slurm not answering (slurmctld restarting) keeps the last list in force, said once (`slurm_unavailable`) until it
answers again (`slurm_recovered`); the discovery loop is woken through `fileno()` when the list changes.

A light touch on slurmctld: four RPCs a look (`squeue` of this user's running jobs and `sinfo -N`, each of which loads
the partitions too), every POLL seconds (40 a minute, a twelfth of the former 0.5 s poll's, well inside what a site's
rate limit, `rl_enable`, lets each user send: bench/slurm_rpcs.py counts them with sdiag), and when Slurm does not
answer, looks further apart, doubling up to BACKOFF_MAX: a busy or throttled slurmctld is not asked harder, and the
job's own `scancel` and `scontrol requeue` find the bucket full. A node's loss is not waited for: its agent's
heartbeats stop within seconds (a node set DOWN ends its steps), and the look that follows says why.
"""

from __future__ import annotations

import threading
from typing import Any

from elastic_control_plane.services.discovery.host_lists import HostLists
from elastic_control_plane.slurm import commands
from elastic_control_plane.slurm.hostlist import allocation_nodes

POLL = 6.0  # seconds between two looks at squeue and sinfo
BACKOFF_MAX = 60.0  # seconds between two looks at most while Slurm does not answer


def next_wait(answered: bool, last_wait: float, poll: float) -> float:
    """Seconds to the next look: `poll` after an answer, else twice the last wait, up to BACKOFF_MAX."""
    return poll if answered else min(BACKOFF_MAX, max(poll, 2 * last_wait))


def job_hosts(jobs: list[Any], states: dict[str, Any], job_id: str) -> dict[str, int | None]:
    """The hosts of job `job_id`: its nodes and its joined allocations', less the lost and drained (slots: the
    agent's own)."""
    return {
        node: None
        for node in allocation_nodes(jobs, job_id)
        if not (node in states and (states[node].lost or states[node].drained))
    }


class SlurmSource(HostLists):
    """The hosts of Slurm job `job_id`, kept by a thread from `start()` to `stop()`; `hosts()` is None until Slurm
    first answered."""

    def __init__(self, job_id: str, log: Any, poll: float = POLL, excluded: list[dict[str, Any]] | None = None) -> None:
        if not job_id.isdigit():
            raise ValueError(f"--slurm-job={job_id!r}: not a Slurm job id")
        self.job_id, self.log, self.poll = job_id, log, poll
        super().__init__()
        self.excluded = excluded or []  # the hosts a requeued job runs without (slurm/exclusions.py), as given
        self._seen: set[str] = set()  # every node the job has held: a node it lost leaves its allocation
        self._down: set[str] = set()  # those Slurm marks DOWN or FAIL now
        self._outage: str | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slurm-nodes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=commands.TIMEOUT + 1)
        self.close()

    def _run(self) -> None:
        wait = 0.0
        while not self._stopping.is_set():
            wait = next_wait(self.look(), wait, self.poll)
            self._stopping.wait(wait)

    def look(self) -> bool:
        """Ask Slurm once; a changed host list wakes the discovery loop. False when Slurm did not answer."""
        try:
            jobs, states = commands.running_jobs(own=True), commands.node_states()
        except commands.SlurmError as exc:
            if self._outage is None:
                self.log.warning("slurm_unavailable", reason=str(exc), effect="the last host list stays in force")
            self._outage = str(exc)
            return False
        if self._outage is not None:
            self.log.info("slurm_recovered", after=self._outage)
            self._outage = None
        hosts = job_hosts(jobs, states, self.job_id)
        self._seen.update(hosts)
        down = {node for node in self._seen if node in states and states[node].lost}
        if hosts != self.hosts() or down != self._down:
            gone = sorted(set(self.hosts() or {}) - set(hosts))
            self.log.info("slurm_hosts", hosts=sorted(hosts), gone=gone, down=sorted(down))
            self.found_lost(down - self._down)
            self._down = down
            self.put(hosts)
        return True
