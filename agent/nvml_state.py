"""The GPUs' own health as NVML reports it, for the host's built-in health check (agent/host_health.py).

NVML (libnvidia-ml.so.1, installed with the NVIDIA driver) is loaded with ctypes. A device fails the check when:
- NVML cannot open it (`nvmlDeviceGetHandleByIndex`: the driver lost it, an XID 79 "fallen off the bus");
- it has retired pages pending (`nvmlDeviceGetRetiredPagesPendingStatus`: it must be reset before the retirement
  takes effect, and until then the bad memory is still in use);
- a row remapping failed (`nvmlDeviceGetRemappedRows`: A100 and later; the memory cannot be repaired in place);
- it counted uncorrectable ECC errors since the driver loaded (`nvmlDeviceGetTotalEccErrors`, volatile).
A query the device does not support (NVML_ERROR_NOT_SUPPORTED: ECC off, an older GPU) is not a failure. Where NVML
is absent the check is skipped; the GPU count check (the driver's list) still runs.
"""

from __future__ import annotations

import ctypes
from typing import Any

NVML_SUCCESS = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0


def load(library: str = "libnvidia-ml.so.1") -> Any | None:
    """NVML, initialised; None where it is absent or does not start."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return None
    return nvml if nvml.nvmlInit_v2() == NVML_SUCCESS else None


def device_failure(nvml: Any, index: int) -> str | None:
    """Why GPU `index` fails (None: it passes, or NVML cannot tell)."""
    handle = ctypes.c_void_p()
    code = nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
    if code != NVML_SUCCESS:
        return f"GPU {index}: NVML cannot open it (error {code})"
    pending = ctypes.c_uint(0)
    if nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle, ctypes.byref(pending)) == NVML_SUCCESS and pending.value:
        return f"GPU {index}: retired memory pages pending (reset the GPU)"
    corrected, uncorrected, remap_pending, failed = (ctypes.c_uint(0) for _ in range(4))
    remapped = nvml.nvmlDeviceGetRemappedRows(
        handle, ctypes.byref(corrected), ctypes.byref(uncorrected), ctypes.byref(remap_pending), ctypes.byref(failed)
    )
    if remapped == NVML_SUCCESS and failed.value:
        return f"GPU {index}: a memory row remapping failed"
    errors = ctypes.c_ulonglong(0)
    counted = nvml.nvmlDeviceGetTotalEccErrors(
        handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, ctypes.byref(errors)
    )
    if counted == NVML_SUCCESS and errors.value:
        return f"GPU {index}: {errors.value} uncorrectable ECC error(s) since the driver loaded"
    return None


def gpus_failure(nvml: Any | None) -> str | None:
    """The first of the machine's GPUs that fails, with why (None: all pass, or no NVML). Every GPU NVML sees is
    checked: CUDA's device numbers need not follow NVML's, and a host with a failing GPU is suspect as a whole."""
    count = ctypes.c_uint(0)
    if nvml is None or nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != NVML_SUCCESS:
        return None
    for index in range(count.value):
        failure = device_failure(nvml, index)
        if failure is not None:
            return failure
    return None
