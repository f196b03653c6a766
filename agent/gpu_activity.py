"""GpuActivity: which processes kept a GPU busy lately, from NVML's per-process utilization samples, so a worker
whose kernels run (while its Python thread waits on a stream) is not taken for a stalled one (agent/wait_watch.py).

NVML (libnvidia-ml.so.1, installed with the NVIDIA driver) is loaded with ctypes: no Python package is needed.
`nvmlDeviceGetProcessUtilization` gives, per device, the processes whose kernels used the SMs since a timestamp;
`busy_pids` asks every device for the samples since its last call. Where NVML is absent (no GPU, no driver) or a
device does not keep per-process samples, `available` is False and the hang watch goes by CPU and I/O alone: the
agent says so once, at start.
"""

from __future__ import annotations

import ctypes
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7


class _Sample(ctypes.Structure):
    """nvmlProcessUtilizationSample_t."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("timeStamp", ctypes.c_ulonglong),
        ("smUtil", ctypes.c_uint),
        ("memUtil", ctypes.c_uint),
        ("encUtil", ctypes.c_uint),
        ("decUtil", ctypes.c_uint),
    ]


class GpuActivity:
    def __init__(self, library: str = "libnvidia-ml.so.1") -> None:
        self.devices: list[Any] = []
        self.last_seen: list[int] = []
        self.reason = ""
        try:
            self._nvml = ctypes.CDLL(library)
        except OSError:
            self.reason = f"{library} not found (no NVIDIA driver)"
            return
        if self._nvml.nvmlInit_v2() != NVML_SUCCESS:
            self.reason = "nvmlInit failed"
            return
        count = ctypes.c_uint(0)
        if self._nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != NVML_SUCCESS or count.value == 0:
            self.reason = "NVML sees no GPU"
            return
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if self._nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == NVML_SUCCESS:
                self.devices.append(handle)
                self.last_seen.append(0)

    @property
    def available(self) -> bool:
        return bool(self.devices)

    def busy_pids(self) -> set[int]:
        """The processes whose kernels used a GPU since the last call."""
        busy: set[int] = set()
        for index, device in enumerate(self.devices):
            for sample in self._samples(device, self.last_seen[index]):
                self.last_seen[index] = max(self.last_seen[index], sample.timeStamp)
                if sample.smUtil > 0:
                    busy.add(sample.pid)
        return busy

    def _samples(self, device: Any, since: int) -> list[_Sample]:
        count = ctypes.c_uint(0)
        code = self._nvml.nvmlDeviceGetProcessUtilization(device, None, ctypes.byref(count), ctypes.c_ulonglong(since))
        if code not in (NVML_SUCCESS, NVML_ERROR_INSUFFICIENT_SIZE) or count.value == 0:
            return []
        samples = (_Sample * count.value)()
        code = self._nvml.nvmlDeviceGetProcessUtilization(
            device, samples, ctypes.byref(count), ctypes.c_ulonglong(since)
        )
        return list(samples[: count.value]) if code == NVML_SUCCESS else []
