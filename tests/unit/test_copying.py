"""snapshot/copying.py: the native and pure-Python paths give the same checksums and bytes; bounds; tensor bytes; the
fallback warning."""

from __future__ import annotations

import subprocess
import sys
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from elastic_control_plane.snapshot import copying
from elastic_control_plane.snapshot.copying import CHUNK

Copy = Callable[[Any, Sequence[tuple[int, Any]], int], int]
Checksum = Callable[[Any, int], int]


def _native_copy(dst: Any, sources: Sequence[tuple[int, Any]], length: int) -> int:
    assert copying.native_copy_checksum is not None
    return copying.native_copy_checksum(dst, sources, length, 2)


def _native_checksum(buf: Any, length: int) -> int:
    assert copying.native_checksum is not None
    return copying.native_checksum(buf, length, 2)


@pytest.fixture(params=["python", "native"])
def path(request: pytest.FixtureRequest) -> tuple[Copy, Checksum]:
    if request.param == "python":
        return copying.python_copy_checksum, copying.python_checksum
    if not copying.native_available():
        pytest.skip("elastic_control_plane.snapshot._snapcopy is not built (run scripts/install.sh with a C compiler)")
    return _native_copy, _native_checksum


def _reference(data: bytes) -> int:
    """The checksum definition, written out."""
    crcs = [zlib.crc32(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)]
    return zlib.crc32(b"".join(crc.to_bytes(4, "little") for crc in crcs))


def _random(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 123])
def test_one_source_fills_the_region(path: tuple[Copy, Checksum], size: int) -> None:
    copy, check = path
    src = _random(size)
    dst = bytearray(size)
    crc = copy(dst, [(0, memoryview(src))], size)
    assert dst == src.tobytes()
    assert crc == _reference(bytes(dst)) == check(dst, size) == check(bytes(dst), size)


def test_every_alignment_and_short_length(path: tuple[Copy, Checksum]) -> None:
    """The native CRC folds 64 bytes at a time and finishes with zlib: cover every start alignment and tail length."""
    _, check = path
    data = _random(1500, seed=10).tobytes()
    for start in range(17):
        for size in (*range(0, 200), 1023, 1024, 1025, 1500 - start):
            piece = data[start : start + size]
            assert check(memoryview(data)[start : start + size], size) == _reference(piece), (start, size)


def test_gaps_keep_the_destination_bytes_and_sources_cross_chunks(path: tuple[Copy, Checksum]) -> None:
    copy, check = path
    length = 3 * CHUNK + 17
    before = _random(length, seed=1)
    dst = before.copy()
    pieces = [
        (CHUNK - 5, _random(10, 2)),
        (100, _random(CHUNK - 200, 3)),
        (2 * CHUNK + 1, _random(CHUNK + 10, 4)),
    ]  # unordered on purpose
    crc = copy(dst, [(offset, memoryview(src)) for offset, src in pieces], length)
    expected = before.copy()
    for offset, src in pieces:
        expected[offset : offset + src.size] = src
    assert np.array_equal(dst, expected)
    assert crc == _reference(expected.tobytes()) == check(dst, length)


def test_many_tiny_sources_and_a_longer_destination(path: tuple[Copy, Checksum]) -> None:
    copy, check = path
    data = _random(2 * CHUNK + 999, seed=5)
    cuts = np.sort(np.random.default_rng(6).choice(np.arange(1, data.size), 3000, replace=False))
    bounds = [0, *cuts.tolist(), data.size]
    sources = [(a, memoryview(data[a:b])) for a, b in zip(bounds, bounds[1:])] + [(7, b"")]
    dst = np.zeros(data.size + 50, np.uint8)
    assert copy(dst, sources, data.size) == _reference(data.tobytes()) == check(dst, data.size)
    assert np.array_equal(dst[: data.size], data) and not dst[data.size :].any()


def test_paths_agree_for_any_thread_count() -> None:
    if not copying.native_available():
        pytest.skip("elastic_control_plane.snapshot._snapcopy is not built")
    data = _random(4 * CHUNK + 3, seed=7)
    sources = [(0, memoryview(data[:1000])), (CHUNK + 1, memoryview(data[CHUNK + 1 :]))]
    expected = _random(data.size, 8)
    crc = copying.python_copy_checksum(expected, sources, data.size)
    for threads in (1, 3, 5, 1000):
        dst = _random(data.size, 8)
        assert copying.native_copy_checksum is not None and copying.native_checksum is not None
        assert copying.native_copy_checksum(dst, sources, data.size, threads) == crc, threads
        assert np.array_equal(dst, expected) and copying.native_checksum(dst, data.size, threads) == crc


def test_one_flipped_byte_changes_the_checksum(path: tuple[Copy, Checksum]) -> None:
    _, check = path
    data = _random(2 * CHUNK + 10, seed=9)
    crc = check(data, data.size)
    for position in (0, CHUNK, data.size - 1):
        flipped = data.copy()
        flipped[position] ^= 0x01
        assert check(flipped, data.size) != crc


@pytest.mark.parametrize(
    "sources, length",
    [([(-1, b"a")], 10), ([(10, b"a")], 10), ([(9, b"ab")], 10), ([(0, b"abc"), (2, b"x")], 10), ([], 11), ([], -1)],
    ids=["negative", "at-end", "past-end", "overlap", "length-past-buffer", "negative-length"],
)
def test_bad_offsets_and_lengths_raise(
    path: tuple[Copy, Checksum], sources: list[tuple[int, bytes]], length: int
) -> None:
    copy, check = path
    dst = bytearray(10)
    with pytest.raises(ValueError):
        copy(dst, sources, length)
    assert dst == bytearray(10)
    with pytest.raises(ValueError):
        check(bytes(10), 11)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.int64, torch.uint8, torch.complex64]
)
def test_tensor_bytes_are_the_tensors_memory(dtype: torch.dtype) -> None:
    tensor = torch.arange(12).reshape(3, 4).to(dtype)
    view = copying.tensor_bytes(tensor)
    assert view.nbytes == tensor.numel() * tensor.element_size()
    restored = torch.frombuffer(bytearray(view), dtype=dtype).reshape(3, 4)
    assert torch.equal(restored, tensor)
    assert copying.tensor_bytes(torch.tensor(1, dtype=dtype)).nbytes == tensor.element_size()
    assert copying.tensor_bytes(torch.empty(0, dtype=dtype)).nbytes == 0


def test_tensor_bytes_share_memory_and_refuse_views_with_gaps() -> None:
    tensor = torch.zeros(4, requires_grad=True)
    view = copying.tensor_bytes(tensor)
    with torch.no_grad():
        tensor[0] = 1.0
    assert bytes(view[:4]) == np.float32(1.0).tobytes()
    with pytest.raises(ValueError):
        copying.tensor_bytes(torch.zeros(4, 4).t())


def test_fallback_warns_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ELASTIC_SNAPSHOT_NATIVE", "0")
    monkeypatch.setattr(copying, "_warned", False)
    data = _random(10)
    dst = bytearray(10)
    assert copying.copy_checksum(dst, [(0, memoryview(data))], 10) == _reference(data.tobytes())
    assert copying.checksum(dst, 10) == _reference(data.tobytes())
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "pure-Python path" in lines[0]


def test_importing_does_not_import_torch() -> None:
    """The agent checksums snapshots and must not import torch."""
    probe = "import sys, snapshot.copying; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_register_pinned_is_false_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert copying.register_pinned(bytearray(4096)) is False
    assert copying.unregister_pinned(bytearray(4096)) is False
