"""torchrun's launch line (elasticctl.torchrun), its environment for a slot, and which commands start warm."""

from __future__ import annotations

import pytest

from elastic_control_plane.elasticctl.torchrun import LaunchError, parse_launch
from elastic_control_plane.slot_processes.torchrun_slot import UNLIMITED_RESTARTS, torchrun_environment
from elastic_control_plane.slot_processes.warm_start import script_argv

PY = "/usr/bin/python3"


def test_the_commonest_launch_line_reads_as_torchrun_reads_it() -> None:
    launch = parse_launch(
        [
            "--nnodes",
            "1:4",
            "--nproc-per-node",
            "8",
            "--max-restarts",
            "3",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "trainer-0:29400",
            "train.py",
            "--lr",
            "0.1",
        ],
        python=PY,
    )
    assert launch.command == [PY, "train.py", "--lr", "0.1"]
    assert (launch.min_np, launch.max_np, launch.max_restarts, launch.control_host) == (8, 32, 3, "trainer-0")


def test_flags_take_underscores_equals_signs_and_torchruns_defaults() -> None:
    launch = parse_launch(
        ["--nproc_per_node=2", "--standalone", "--rdzv-endpoint=10.0.0.1:29400", "train.py"], python=PY
    )
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node, launch.max_restarts) == (1, 1, 2, 0)
    assert launch.control_host is None, "--standalone runs the whole system here"


def test_module_and_no_python_start_the_command_as_torchrun_does() -> None:
    assert parse_launch(["-m", "pkg.train", "--epochs", "2"], python=PY).command == [
        PY,
        "-m",
        "pkg.train",
        "--epochs",
        "2",
    ]
    assert parse_launch(["--no-python", "./train.sh", "x"], python=PY).command == ["./train.sh", "x"]
    assert parse_launch(["--", "train.py", "--nnodes", "9"], python=PY).command == [PY, "train.py", "--nnodes", "9"], (
        "the script's own flags are its own"
    )


@pytest.mark.parametrize("endpoint, host", [("h:1", "h"), ("h", "h"), ("[::1]:29400", "::1"), ("[fe80::1]", "fe80::1")])
def test_the_rdzv_endpoint_names_the_control_planes_host(endpoint: str, host: str) -> None:
    assert parse_launch(["--rdzv-endpoint", endpoint, "t.py"]).control_host == host


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--node-rank", "0", "t.py"], "--node-rank is not supported"),
        (["--nnodes", "0", "t.py"], "--nnodes wants a whole number of at least 1, got '0'"),
        (["--max-restarts", "-1", "t.py"], "--max-restarts wants a whole number of at least 0, got '-1'"),
        (["--nproc-per-node"], "--nproc-per-node needs a value"),
        (["--nnodes", "2"], "missing the script"),
    ],
)
def test_what_it_does_not_run_is_refused(argv: list[str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        parse_launch(argv)


SLOT = {
    "round": 3,
    "rank": 5,
    "size": 8,
    "local_rank": 1,
    "local_size": 4,
    "cross_rank": 1,
    "cross_size": 2,
    "snapshot_writer": False,
}


def test_a_slots_environment_is_torchruns_for_its_place_in_the_round() -> None:
    env = torchrun_environment(SLOT, "10.0.0.2:4711", 3, "job-key", {})
    assert env == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_NAME": "default",
        "ROLE_RANK": "5",
        "ROLE_WORLD_SIZE": "8",
        "MASTER_ADDR": "10.0.0.2",
        "MASTER_PORT": "4711",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "job-key",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "ELASTIC_SNAPSHOT_WRITER": "0",
        "OMP_NUM_THREADS": "1",
    }


def test_omp_threads_are_left_to_the_job_and_to_one_worker_per_host_and_an_ipv6_store_address_splits_at_its_port() -> (
    None
):
    assert "OMP_NUM_THREADS" not in torchrun_environment(SLOT, "h:1", None, "k", {"OMP_NUM_THREADS": "6"})
    alone = torchrun_environment({**SLOT, "local_size": 1}, "h:1", None, "k", {})
    assert "OMP_NUM_THREADS" not in alone and alone["TORCHELASTIC_MAX_RESTARTS"] == str(UNLIMITED_RESTARTS)
    ipv6 = torchrun_environment({**SLOT, "snapshot_writer": True}, "fd00::2:4711", None, "k", {})
    assert (ipv6["MASTER_ADDR"], ipv6["MASTER_PORT"], ipv6["ELASTIC_SNAPSHOT_WRITER"]) == ("fd00::2", "4711", "1")


@pytest.mark.parametrize(
    "command, argv",
    [
        ([PY, "train.py", "--lr", "1"], ["train.py", "--lr", "1"]),
        (["python", "-m", "pkg.train"], ["-m", "pkg.train"]),
        ([PY, "-u", "train.py"], None),
        (["bash", "train.sh"], None),
        ([PY], None),
        ([PY, "-m"], None),
    ],
)
def test_only_python_scripts_and_modules_start_warm(command: list[str], argv: list[str] | None) -> None:
    assert script_argv(command) == argv
