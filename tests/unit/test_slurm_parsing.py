"""What Slurm prints, parsed (slurm/hostlist.py, slurm/allocation.py, services/discovery/slurm.py): every sample is
output captured from the real Slurm 22.05 of scripts/slurm.sh (`scontrol show hostnames`, `sinfo -N -o '%N|%T'`,
`scontrol show node`, `squeue -O JobID:|,HetJobID:|,Comment:|,NodeList:`, a heterogeneous job's environment)."""

from __future__ import annotations

import pytest

from elastic_control_plane.services.discovery.slurm import SlurmSource, job_hosts
from elastic_control_plane.slurm.allocation import allocation_groups
from elastic_control_plane.slurm.hostlist import (
    NodeState,
    SlurmOutputError,
    allocation_nodes,
    expand_hostlist,
    parse_node_states,
    parse_scontrol_fields,
    parse_squeue,
)

# `scontrol show hostnames EXPR` on this machine's Slurm, one line per host (joined here).
HOSTNAMES = {
    "node[1-3]": "node1 node2 node3",
    "node[1,3]": "node1 node3",
    "node[01-03],gpu[8-10]": "node01 node02 node03 gpu8 gpu9 gpu10",
    "a-[1-2]-[3-4]": "a-1-3 a-1-4 a-2-3 a-2-4",
    "node1,node3": "node1 node3",
    "x[009-011]": "x009 x010 x011",
}


@pytest.mark.parametrize("expression", sorted(HOSTNAMES))
def test_host_lists_expand_as_scontrol_show_hostnames_does(expression: str) -> None:
    assert expand_hostlist(expression) == HOSTNAMES[expression].split()


@pytest.mark.parametrize("bad", ["node[1-", "node]", "node[a-b]", "node[3-1]", "node[[1]]", "node 1"])
def test_a_host_list_that_cannot_be_read_is_refused(bad: str) -> None:
    # scontrol prints `node]` for `node[1-` and exits 0: a guess we do not make.
    with pytest.raises(SlurmOutputError, match="not a host list"):
        expand_hostlist(bad)


def test_empty_host_lists() -> None:
    assert expand_hostlist("") == [] and expand_hostlist("(null)") == []


SINFO = "node1|down\nnode2|draining\nnode3|mixed-\n"  # node1 set DOWN, node2 DRAIN with a job on it


def test_node_states_from_sinfo() -> None:
    states = parse_node_states(SINFO)
    assert states["node1"].lost and not states["node1"].drained
    assert states["node2"].drained and not states["node2"].lost
    assert not states["node3"].lost and not states["node3"].drained


@pytest.mark.parametrize(
    ("state", "lost", "drained", "responding"),
    [
        ("idle", False, False, True),
        ("idle*", False, False, False),  # slurmd not answering: the agent's heartbeats decide
        ("mixed*", False, False, False),
        ("MIXED+DRAIN+PLANNED", False, True, True),  # scontrol show node's State=
        ("DOWN", True, False, True),
        ("down*", True, False, False),
        ("drained", False, True, True),
        ("fail", True, False, True),
        ("allocated+drain~", False, True, True),
    ],
)
def test_node_state_words(state: str, lost: bool, drained: bool, responding: bool) -> None:
    parsed = NodeState.parse(state)
    assert (parsed.lost, parsed.drained, parsed.responding) == (lost, drained, responding)


@pytest.mark.parametrize("bad", ["", "no state", "node1", "idle|x"])
def test_a_node_state_that_cannot_be_read_is_refused(bad: str) -> None:
    with pytest.raises(SlurmOutputError):
        NodeState.parse(bad)


def test_a_sinfo_line_without_a_state_is_refused() -> None:
    with pytest.raises(SlurmOutputError, match="node\\|state"):
        parse_node_states("node1\n")


SCONTROL_NODE = """NodeName=node2 Arch=x86_64 CoresPerSocket=2
   CPUAlloc=1 CPUEfctv=2 CPUTot=2 CPULoad=1.08
   NodeAddr=127.0.0.1 NodeHostName=localhost Port=17002 Version=22.05.8
   State=MIXED+DRAIN+PLANNED ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
"""


def test_scontrol_show_node_fields() -> None:
    fields = parse_scontrol_fields(SCONTROL_NODE)
    assert fields["NodeAddr"] == "127.0.0.1" and NodeState.parse(fields["State"]).drained


# A heterogeneous job (3: node3, and its component 4: node2), one that joined job 3, and an unrelated one.
SQUEUE = "3|3|(null)|node3\n4|3|(null)|node2\n7|N/A|elastic-join=3|node[1-2]\n8|N/A|(null)|node1\n"


def test_the_nodes_of_a_job_its_components_and_the_allocations_that_joined_it() -> None:
    jobs = parse_squeue(SQUEUE)
    assert [(j.job_id, j.het_job_id, j.comment) for j in jobs][:3] == [
        ("3", "3", ""),
        ("4", "3", ""),
        ("7", "7", "elastic-join=3"),
    ]
    assert allocation_nodes(jobs, "3") == ["node3", "node2", "node1"]
    assert allocation_nodes(jobs, "8") == ["node1"]
    assert allocation_nodes(jobs, "99") == []


def test_a_squeue_line_that_cannot_be_read_is_refused() -> None:
    with pytest.raises(SlurmOutputError, match="squeue"):
        parse_squeue("JOBID PARTITION NAME\n")


def test_discovery_leaves_out_the_nodes_slurm_marks_down_or_drained() -> None:
    jobs = parse_squeue("10|N/A|(null)|node[1-3]\n")
    assert job_hosts(jobs, parse_node_states(SINFO), "10") == {"node3": None}
    assert job_hosts(jobs, parse_node_states("node1|idle*\nnode2|mixed\n"), "10") == {
        "node1": None,
        "node2": None,
        "node3": None,
    }


def test_discovery_refuses_a_job_id_that_is_not_one() -> None:
    with pytest.raises(ValueError, match="not a Slurm job id"):
        SlurmSource("12;rm", log=None)


HET_ENV = {  # the batch shell's environment of `sbatch -N1 -w node3 : -N1 -w node2`
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_NODELIST": "node3",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "node3",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "node2",
}


def test_every_component_of_a_heterogeneous_job_gets_agents() -> None:
    assert allocation_groups(HET_ENV) == [(0, "node3"), (1, "node2")]
    assert allocation_groups({"SLURM_JOB_NODELIST": "node[1-3]"}) == [(None, "node1"), (None, "node2"), (None, "node3")]
    with pytest.raises(SlurmOutputError, match="HET_GROUP_1"):
        allocation_groups({"SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "node3"})
    with pytest.raises(SlurmOutputError, match="SLURM_JOB_NODELIST"):
        allocation_groups({})
