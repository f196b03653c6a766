"""A worker's bad day against the round's key store (issue 58): rank 0's script sets junk keys in its round past the
round's quota; they are refused `quota`, `elasticctl status` names its host and no other, and the job trains to its
end: the next rounds form, nothing of it spills on the other host."""

from __future__ import annotations

import sys

from testing.harness import Cluster

JUNK = 24  # past the round's 16 keys (its store's address among them)
SCRIPT = f"""
import libworker as e
from elastic_control_plane.bus.client import ServiceError
from libworker.world import world
e.init()
if e.rank() == 0:
    codes = set()
    for n in range({JUNK}):
        try:
            world.link.requests.request("kv_set", {{"key": world.slot["prefix"] + f"junk{{n}}"}}, raw=(b"x",))
        except ServiceError as exc:
            codes.add(exc.code)
    print("refused:", sorted(codes), flush=True)
e.barrier()
"""


def test_junk_keys_past_a_rounds_quota_are_refused_and_shown_in_status_naming_the_guilty_host_only(
    cluster: Cluster,
) -> None:
    cluster.start_agent("host-1", 1)
    cluster.start_agent("host-2", 1)
    job = cluster.submit("--min-np", "2", "--", sys.executable, "-c", SCRIPT)
    assert cluster.wait_job_end(job, 120) == 0, cluster.output("elasticctl-run")
    agents = cluster.output("agent-host-1") + cluster.output("agent-host-2")
    assert "refused: ['quota']" in agents, agents[-3000:]
    guilty = "host-1" if "[host-1:0] refused" in agents else "host-2"
    shown = cluster.elasticctl("status")
    assert shown.returncode == 0, shown.stderr
    said = [line.strip() for line in shown.stdout.splitlines() if "quota" in line]
    assert len(said) == 1 and said[0].startswith(f"{guilty}: "), shown.stdout
