"""GPUs: the agent's detection without torch (CUDA_VISIBLE_DEVICES, /proc, nvidia-smi), slots per GPU,
`elasticctl local`'s split of GPUs among its agents, and the worker's device binding and backend."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_control_plane.agent.gpus import (
    check_slots,
    default_slots,
    gpu_devices,
    nvidia_smi_gpu_count,
    visible_devices,
)
from elastic_control_plane.elasticctl.control import CommandError
from elastic_control_plane.elasticctl.local import agent_devices
from libworker import devices

REPO = Path(__file__).resolve().parents[2]
SMI_OUTPUT = (
    "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)\n  MIG 1g.10gb Device 0: (UUID: MIG-bbbb)\nGPU 1: NVIDIA H100 "
    "80GB HBM3 (UUID: GPU-cccc)\n"
)


def fake_nvidia_smi(directory: Path, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0,1", ["0", "1"]),
        (" 2 , 3 ", ["2", "3"]),
        ("GPU-aaaa,MIG-bbbb", ["GPU-aaaa", "MIG-bbbb"]),
        ("", []),
        ("-1", []),
        ("NoDevFiles", []),
        ("0,-1,2", ["0"]),
    ],
)
def test_cuda_visible_devices_lists_devices_up_to_the_first_invalid_entry(value: str, expected: list[str]) -> None:
    assert visible_devices(value) == expected


def test_cuda_visible_devices_wins_over_the_driver(tmp_path: Path) -> None:
    (tmp_path / "gpus" / "0000:3b:00.0").mkdir(parents=True)
    assert gpu_devices({"CUDA_VISIBLE_DEVICES": "5,7"}, tmp_path / "gpus") == ["5", "7"]
    assert gpu_devices({"CUDA_VISIBLE_DEVICES": ""}, tmp_path / "gpus") == []


def test_the_driver_directory_counts_gpus_even_when_nvidia_smi_says_otherwise(tmp_path: Path) -> None:
    for bus_id in ("0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0"):
        (tmp_path / "gpus" / bus_id).mkdir(parents=True)
    fake_nvidia_smi(tmp_path / "bin", "exit 0")
    assert gpu_devices({"PATH": str(tmp_path / "bin")}, tmp_path / "gpus") == ["0", "1", "2"]


def test_nvidia_smi_lines_count_when_the_driver_directory_is_absent(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", f"printf '{SMI_OUTPUT}'")
    assert gpu_devices({"PATH": str(tmp_path / "bin")}, tmp_path / "absent") == ["0", "1"]


def test_no_driver_and_no_nvidia_smi_means_no_gpus(tmp_path: Path) -> None:
    assert gpu_devices({"PATH": str(tmp_path)}, tmp_path / "absent") == []
    assert gpu_devices({}, tmp_path / "absent") == []


def test_a_failing_or_hanging_nvidia_smi_means_no_gpus(tmp_path: Path) -> None:
    failing = fake_nvidia_smi(tmp_path / "failing", f"printf '{SMI_OUTPUT}'; exit 9")
    hanging = fake_nvidia_smi(tmp_path / "hanging", "exec sleep 30")
    assert nvidia_smi_gpu_count(str(failing)) == 0
    assert nvidia_smi_gpu_count(str(hanging), timeout=0.2) == 0
    assert nvidia_smi_gpu_count(str(tmp_path / "missing")) == 0


def test_slots_default_to_one_per_gpu_and_more_need_sharing() -> None:
    assert (default_slots(0), default_slots(1), default_slots(8)) == (1, 1, 8)
    check_slots(4, 0, share_gpus=False)
    check_slots(2, 2, share_gpus=False)
    check_slots(4, 1, share_gpus=True)
    with pytest.raises(
        ValueError, match=r"--slots 3 is more than this host's 2 GPU\(s\); lower --slots or pass --share-gpus"
    ):
        check_slots(3, 2, share_gpus=False)


def run_agent(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.agent.main", *args],
        env=environ,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_agent_refuses_more_slots_than_gpus_in_one_line() -> None:
    result = run_agent("--host", "h1", "--slots", "3", CUDA_VISIBLE_DEVICES="0,1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "elastic-agent: --slots 3 is more than this host's 2 GPU(s); lower --slots or pass --share-gpus to run "
        "several workers per GPU"
    ]


def test_the_agent_imports_no_torch() -> None:
    probe = "import sys, agent.main; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.stdout.strip() == "False", result.stderr


def test_local_splits_the_gpus_among_its_agents() -> None:
    assert default_slots(0, 2) == 1, "one worker per agent without GPUs, as an agent alone"
    assert default_slots(8, 2) == 4
    assert default_slots(1, 2) == 1
    assert agent_devices(["0", "1", "2", "3"], 2, 2, share_gpus=False) == ["0,1", "2,3"]
    assert agent_devices(["4", "6", "7"], 2, 1, share_gpus=False) == ["4", "6"]
    assert agent_devices([], 2, 2, share_gpus=False) == [None, None]
    assert agent_devices(["0"], 2, 2, share_gpus=True) == [None, None]
    with pytest.raises(CommandError, match=r"--hosts 2 x --slots 2 needs 4 GPUs, this machine has 3"):
        agent_devices(["0", "1", "2"], 2, 2, share_gpus=False)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Two CUDA devices that exist only for libworker.devices; returns the devices it was bound to."""
    bound: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setenv("ELASTIC_AGENT", "ipc:///tmp/agent-test.sock")
    monkeypatch.delenv("ELASTIC_GPU_SHARED", raising=False)
    return bound


def test_backend_is_gloo_without_cuda_nccl_with_it_and_gloo_on_shared_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTIC_GPU_SHARED", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.backend() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setenv("ELASTIC_GPU_SHARED", "0")
    assert devices.backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setenv("ELASTIC_GPU_SHARED", "1")
    assert devices.backend() == "cpu:gloo,cuda:gloo"


def test_a_worker_is_bound_to_the_gpu_of_its_local_rank(fake_cuda: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_LOCAL_RANK", "1")
    devices.bind_device()
    assert fake_cuda == [1]


def test_shared_gpus_are_bound_round_robin(fake_cuda: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_GPU_SHARED", "1")
    for local_rank in range(4):
        monkeypatch.setenv("ELASTIC_LOCAL_RANK", str(local_rank))
        devices.bind_device()
    assert fake_cuda == [0, 1, 0, 1]


def test_a_local_rank_without_a_gpu_of_its_own_is_a_clear_error(
    fake_cuda: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_LOCAL_RANK", "2")
    with pytest.raises(
        RuntimeError,
        match=r"local rank 2 has no GPU of its own: this host has 2 GPU\(s\); lower the agent's --slots or start it "
        r"with --share-gpus",
    ):
        devices.bind_device()
    assert fake_cuda == []


def test_nothing_is_bound_outside_an_agent_or_without_cuda(
    fake_cuda: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_LOCAL_RANK", "0")
    monkeypatch.delenv("ELASTIC_AGENT")
    devices.bind_device()
    monkeypatch.setenv("ELASTIC_AGENT", "ipc:///tmp/agent-test.sock")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    devices.bind_device()
    assert fake_cuda == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_real_gpu_the_worker_binds_and_gloo_reduces_cuda_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_AGENT", "ipc:///tmp/agent-test.sock")
    monkeypatch.setenv("ELASTIC_LOCAL_RANK", "0")
    monkeypatch.setenv("ELASTIC_GPU_SHARED", "1")
    devices.bind_device()
    assert torch.cuda.current_device() == 0
    dist.init_process_group(devices.backend(), store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensor = torch.ones(4, device="cuda")
        dist.all_reduce(tensor)
        assert tensor.device.type == "cuda" and tensor.tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()
