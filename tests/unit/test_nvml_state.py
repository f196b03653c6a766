"""The NVML part of the host's health check against a stand-in for libnvidia-ml (no GPU here): healthy GPUs and
queries a GPU does not support pass; a GPU NVML cannot open, with retired pages pending, a failed row remapping or
uncorrectable ECC errors fails the host, named; no NVML, no verdict."""

from __future__ import annotations

from typing import Any

import pytest

from elastic_control_plane.agent import nvml_state

NOT_SUPPORTED = 3


class StandInNvml:
    """Answers NVML's calls as the C library does: a return code, and values written through the pointers."""

    def __init__(self, devices: list[dict[str, Any]]) -> None:
        self.devices = devices

    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        count._obj.value = len(self.devices)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index: int, handle: Any) -> int:
        handle._obj.value = index + 1
        return self.devices[index].get("open", 0)

    def _device(self, handle: Any) -> dict[str, Any]:
        return self.devices[handle.value - 1]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, pending: Any) -> int:
        pending._obj.value = self._device(handle).get("pending", 0)
        return self._device(handle).get("pending_code", 0)

    def nvmlDeviceGetRemappedRows(
        self, handle: Any, corrected: Any, uncorrected: Any, pending: Any, failed: Any
    ) -> int:
        failed._obj.value = self._device(handle).get("remap_failed", 0)
        return self._device(handle).get("remap_code", 0)

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, kind: int, counter: int, count: Any) -> int:
        assert (kind, counter) == (nvml_state.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml_state.NVML_VOLATILE_ECC)
        count._obj.value = self._device(handle).get("ecc", 0)
        return self._device(handle).get("ecc_code", 0)


def test_healthy_gpus_and_unsupported_queries_pass() -> None:
    unsupported = {"pending_code": NOT_SUPPORTED, "remap_code": NOT_SUPPORTED, "ecc_code": NOT_SUPPORTED, "ecc": 9}
    assert nvml_state.gpus_failure(StandInNvml([{}, {}, unsupported])) is None


@pytest.mark.parametrize(
    ("device", "reason"),
    [
        ({"open": 15}, "GPU 1: NVML cannot open it (error 15)"),
        ({"pending": 1}, "GPU 1: retired memory pages pending (reset the GPU)"),
        ({"remap_failed": 1}, "GPU 1: a memory row remapping failed"),
        ({"ecc": 2}, "GPU 1: 2 uncorrectable ECC error(s) since the driver loaded"),
    ],
)
def test_a_failing_gpu_fails_the_host_and_is_named(device: dict[str, Any], reason: str) -> None:
    assert nvml_state.gpus_failure(StandInNvml([{}, device, {}])) == reason


def test_without_nvml_there_is_no_verdict() -> None:
    assert nvml_state.gpus_failure(None) is None
    assert nvml_state.load("libnvidia-ml-absent.so.1") is None
