"""Copying tensors into a snapshot buffer and checksumming it: the native extension when built, else a pure-Python path.

`copy_checksum(dst, sources, length)` copies each `(offset, buffer)` of
`sources` into `dst` at `offset` and returns the checksum of `dst[0:length]`;
`checksum(buf, length)` checksums a region (to verify before restoring).

The checksum: cut the region into consecutive CHUNK-byte pieces (the last may
be shorter, an empty region has none); crc_i = `zlib.crc32(piece_i)`; the
checksum is `zlib.crc32` of the crc_i as 4-byte little-endian words, in order.
Both paths give the same ints and the same destination bytes. Sources must
lie inside `[0, length)`, must not overlap one another (ValueError) nor the
destination's memory; bytes of `dst` no source covers are kept.

`elastic_control_plane.snapshot._snapcopy` (native/snapcopy.c, built by scripts/install.sh when a C
compiler is there) is used unless `ELASTIC_SNAPSHOT_NATIVE=0`; without it the
first copy or checksum writes one warning line on stderr. Both paths are
exposed (`python_*`, `native_*`) for the tests and the benchmark.

Also the two buffer helpers a snapshot writer needs: `tensor_bytes` (a
tensor's raw bytes without a copy) and `register_pinned` /
`unregister_pinned` (page-locking a buffer for CUDA, best effort). They import
torch when called: the agent checksums snapshots and must not import torch.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import sys
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

CHUNK = 1 << 20
THREADS = min(os.cpu_count() or 1, 8)

Source = tuple[int, Any]  # (offset in the destination, a C-contiguous buffer)

try:
    from elastic_control_plane.snapshot import _snapcopy
except ImportError as exc:
    _snapcopy = None
    _missing = f"{type(exc).__name__}: {exc}"
else:
    if _snapcopy.CHUNK != CHUNK:
        _missing = f"stale build: its CHUNK is {_snapcopy.CHUNK}, not {CHUNK}"
        _snapcopy = None

native_copy_checksum: Callable[[Any, Sequence[Source], int, int], int] | None = (
    _snapcopy.copy_checksum if _snapcopy else None
)
native_checksum: Callable[[Any, int, int], int] | None = _snapcopy.checksum if _snapcopy else None

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_warned = False


def native_available() -> bool:
    """Whether the native extension is built and importable (ELASTIC_SNAPSHOT_NATIVE=0 may still turn it off)."""
    return _snapcopy is not None


def copy_checksum(dst: Any, sources: Sequence[Source], length: int) -> int:
    """Copy each (offset, buffer) into the writable buffer `dst` and return the checksum of dst[0:length]."""
    if _native():
        return _snapcopy.copy_checksum(dst, sources, length, THREADS)
    return python_copy_checksum(dst, sources, length)


def checksum(buf: Any, length: int) -> int:
    """The checksum of buf[0:length]."""
    if _native():
        return _snapcopy.checksum(buf, length, THREADS)
    return python_checksum(buf, length)


def python_copy_checksum(dst: Any, sources: Sequence[Source], length: int) -> int:
    """`copy_checksum` in Python: numpy copies and zlib CRCs on a thread pool, one task per chunk."""
    out = _array(dst, writable=True)
    _check_length(length, out.nbytes, "destination")
    spans = _spans(sources, length)
    starts = [offset for offset, _ in spans]

    def piece(start: int, stop: int) -> int:
        first = max(bisect.bisect_right(starts, start) - 1, 0)
        for offset, src in spans[first : bisect.bisect_left(starts, stop)]:
            a, b = max(offset, start), min(offset + src.nbytes, stop)
            if a < b:
                np.copyto(out[a:b], src[a - offset : b - offset])
        return zlib.crc32(out[start:stop])

    return _chunked(piece, length)


def python_checksum(buf: Any, length: int) -> int:
    """`checksum` in Python."""
    data = _array(buf, writable=False)
    _check_length(length, data.nbytes, "checksummed")
    return _chunked(lambda start, stop: zlib.crc32(data[start:stop]), length)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor of any dtype, without a copy (the view keeps the tensor alive)."""
    import torch

    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"tensor_bytes needs a contiguous CPU tensor, got {tensor.device} contiguous={tensor.is_contiguous()}"
        )
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def register_pinned(buffer: Any) -> bool:
    """Page-lock `buffer` for CUDA so device-to-host copies into it run asynchronously; False without CUDA or on
    failure."""
    import torch

    if not torch.cuda.is_available():
        return False
    data = _array(buffer, writable=False)
    return data.nbytes > 0 and _cuda_ok(
        torch.cuda.cudart().cudaHostRegister(data.ctypes.data, data.nbytes, 1)
    )  # 1: cudaHostRegisterPortable


def unregister_pinned(buffer: Any) -> bool:
    """Undo `register_pinned` (before the buffer is unmapped); False without CUDA or when it was not registered."""
    import torch

    return torch.cuda.is_available() and _cuda_ok(
        torch.cuda.cudart().cudaHostUnregister(_array(buffer, writable=False).ctypes.data)
    )


def _cuda_ok(error: Any) -> bool:
    """Whether a CUDA runtime call made through torch succeeded. A failed call leaves the thread's last CUDA error set,
    which torch would raise at its next kernel launch: read it (clearing it) from every libcudart loaded, since torch
    exposes no cudaGetLastError."""
    if int(error) == 0:
        return True
    with open("/proc/self/maps") as maps:
        paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "libcudart" in line}
    for path in paths:
        if os.path.isfile(path):  # not "... (deleted)"
            ctypes.CDLL(path).cudaGetLastError()
    return False


def _native() -> bool:
    global _warned
    if _snapcopy is not None and os.environ.get("ELASTIC_SNAPSHOT_NATIVE") != "0":
        return True
    if not _warned:
        _warned = True
        if _snapcopy is not None:
            line = "snapshot: native copy disabled by ELASTIC_SNAPSHOT_NATIVE=0, using the pure-Python path"
        else:
            line = (
                f"snapshot: native copy not built ({_missing}), using the pure-Python path; run scripts/install.sh "
                "with a C compiler for faster commits"
            )
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    return False


def _array(buffer: Any, *, writable: bool) -> np.ndarray:
    data = np.frombuffer(buffer, dtype=np.uint8)
    if writable and not data.flags.writeable:
        raise BufferError("the destination buffer is read-only")
    return data


def _check_length(length: int, size: int, name: str) -> None:
    if not 0 <= length <= size:
        raise ValueError(f"length {length} outside the {name} buffer of {size} bytes")


def _spans(sources: Sequence[Source], length: int) -> list[tuple[int, np.ndarray]]:
    """The non-empty sources as (offset, bytes), sorted by offset; ValueError when one lies outside [0, length) or two
    overlap."""
    spans = []
    for index, (offset, buffer) in enumerate(sources):
        data = _array(buffer, writable=False)
        if not (0 <= offset <= length and data.nbytes <= length - offset):
            raise ValueError(
                f"source {index}: bytes [{offset}, {offset} + {data.nbytes}) outside the region of {length} bytes"
            )
        if data.nbytes:
            spans.append((offset, data))
    spans.sort(key=lambda span: span[0])
    for (offset, data), (next_offset, _) in zip(spans, spans[1:]):
        if offset + data.nbytes > next_offset:
            raise ValueError(f"sources overlap at offset {next_offset}")
    return spans


def _chunked(piece: Callable[[int, int], int], length: int) -> int:
    """Run piece(start, stop) over the CHUNK-sized pieces of [0, length) and combine their CRCs."""
    bounds = [(start, min(start + CHUNK, length)) for start in range(0, length, CHUNK)]
    if len(bounds) > 1:
        crcs = list(_executor().map(lambda b: piece(*b), bounds))
    else:
        crcs = [piece(*b) for b in bounds]
    return zlib.crc32(b"".join(crc.to_bytes(4, "little") for crc in crcs))


def _forget_pool() -> None:
    """In a forked child the pool's threads are gone (submitting would hang) and the lock may be held: start afresh."""
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="snapshot-copy")
        return _pool
