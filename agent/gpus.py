"""This host's GPUs, found without importing torch (the agent must start fast), and the slots they allow.

The GPUs are, in this order of preference: the entries of `CUDA_VISIBLE_DEVICES`
when it is set (CUDA stops at the first invalid entry: `-1`, or Slurm's
`NoDevFiles`); the entries of `/proc/driver/nvidia/gpus` when the driver is
loaded; the `GPU ` lines of `nvidia-smi -L` when that binary is on the PATH;
otherwise none. A host's slots default to its GPU count (1 without GPUs);
more slots than GPUs need `--share-gpus`, several workers per GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

PROC_GPUS = Path("/proc/driver/nvidia/gpus")
NVIDIA_SMI_TIMEOUT = 5.0
INVALID_DEVICES = ("-1", "NoDevFiles")


def visible_devices(value: str) -> list[str]:
    """The devices a `CUDA_VISIBLE_DEVICES` value exposes, as written (indices or UUIDs)."""
    devices = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry in INVALID_DEVICES:
            break
        devices.append(entry)
    return devices


def proc_gpu_count(directory: Path) -> int | None:
    """GPUs the NVIDIA driver lists under `directory`; None when the driver is not loaded."""
    try:
        return len(list(directory.iterdir()))
    except OSError:
        return None


def nvidia_smi_gpu_count(binary: str, timeout: float = NVIDIA_SMI_TIMEOUT) -> int:
    """GPUs `nvidia-smi -L` lists; 0 when it fails or does not answer in `timeout` seconds."""
    try:
        result = subprocess.run([binary, "-L"], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if result.returncode != 0:
        return 0
    return sum(line.startswith("GPU ") for line in result.stdout.splitlines())


def gpu_devices(environ: Mapping[str, str] = os.environ, proc_dir: Path = PROC_GPUS) -> list[str]:
    """This host's GPUs as CUDA device names (what `CUDA_VISIBLE_DEVICES` accepts); [] without GPUs."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return visible_devices(environ["CUDA_VISIBLE_DEVICES"])
    count = proc_gpu_count(proc_dir)
    if count is None:
        binary = shutil.which("nvidia-smi", path=environ.get("PATH", ""))
        count = nvidia_smi_gpu_count(binary) if binary else 0
    return [str(index) for index in range(count)]


def default_slots(gpus: int, agents: int = 1) -> int:
    """One worker per GPU, the machine's GPUs split among the `agents` that run on it (at least one each); one worker
    per agent without GPUs."""
    return max(1, gpus // agents) if gpus else 1


def check_slots(slots: int, gpus: int, share_gpus: bool) -> None:
    """Raise ValueError when a GPU host is given more slots than GPUs without sharing them."""
    if gpus and slots > gpus and not share_gpus:
        raise ValueError(
            f"--slots {slots} is more than this host's {gpus} GPU(s); lower --slots or pass --share-gpus to run "
            "several workers per GPU"
        )


def check_standby(standby: int, slots: int) -> None:
    """Raise ValueError when a host is asked to keep more standbys than it has slots: a standby only ever takes the
    slot of a crashed worker, so more spares than slots would hold memory (and a GPU when admitted) for nothing."""
    if standby < 0:
        raise ValueError(f"--standby {standby} must be 0 or more")
    if standby > slots:
        raise ValueError(
            f"--standby {standby} is more than this host's {slots} slot(s): a host keeps at most one standby per slot"
        )
