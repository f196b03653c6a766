"""Writing a committed state tree into a host's snapshot so no crash can tear it, and reading the newest back.

The layout is `snapshot.layout`. A writer first zeroes the header of the buffer
it overwrites (the older one), then writes the payload and checksums it while
copying, and writes the header last: a writer that dies at any point leaves
that buffer invalid and the other buffer intact. A reader takes the valid buffer
with the highest commit whose checksum matches; a buffer with a bad checksum or
of another job is rejected with a log line, never restored. The metadata (the
tree's skeleton and where each tensor lies) is data (msgpack:
snapshot/skeleton_codec.py), a user's own object in the state pickled inside
it; a file written before that, whose metadata is pickled whole, still loads.
"""

from __future__ import annotations

import mmap
import os
import pickle
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import cloudpickle
import msgpack
import numpy as np
import torch

from elastic_control_plane.snapshot import copying, skeleton_codec
from elastic_control_plane.snapshot.layout import (
    ALIGN,
    HEADER_BYTES,
    INVALID,
    PAYLOAD_START,
    BufferHeader,
    buffer_paths,
    read_header,
)
from elastic_control_plane.snapshot.tree import rebuild, split

_GROWTH = 1 << 20
Reject = Callable[[str, str], None]


class SnapshotError(RuntimeError):
    """A snapshot could not be written (e.g. shared memory is full); the previous one is intact."""


@dataclass(frozen=True)
class Snapshot:
    commit: int
    tree: Any
    written_at: float
    nbytes: int
    path: str
    job: str = ""  # the key of the job that wrote it


class StoredTensor(NamedTuple):
    """Where one tensor of the tree lies in the payload, and what it was (the metadata keeps a list of these, as
    plain tuples: a file names no class of this module)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    cuda: bool


TensorSpec = StoredTensor  # the class that snapshots written before the metadata held plain tuples name


def lay_out(tensors: list[torch.Tensor]) -> tuple[list[StoredTensor], int]:
    """Each tensor's spec, at aligned offsets from the payload's start; and where the metadata then starts."""
    specs, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        specs.append(
            StoredTensor(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes, tensor.is_cuda)
        )
        offset = _aligned(offset + nbytes)
    return specs, offset


def copy_into(payload: memoryview, copies: list[tuple[torch.Tensor, StoredTensor]]) -> None:
    """Copy tensors into their places in the payload, without waiting (on CUDA: device to host, asynchronously)."""
    whole = torch.frombuffer(payload, dtype=torch.uint8)
    for tensor, spec in copies:
        whole[spec.offset : spec.offset + spec.nbytes].view(tensor.dtype).view(tensor.shape).copy_(
            tensor, non_blocking=True
        )
    del whole


class SnapshotWriter:
    """The writing side of a host's snapshot, kept by the one worker that writes it: the buffers stay mapped."""

    def __init__(self, prefix: str, job: str) -> None:
        self.prefix, self.job = prefix, job
        self.paths = buffer_paths(prefix)
        self._maps: list[tuple[int, mmap.mmap] | None] = [None, None]
        self._pinned: set[int] = set()

    def write(self, commit: int, tree: Any) -> int:
        """Write `tree` as commit `commit` into the older buffer; returns the bytes written. Raises SnapshotError
        (with both buffers as they were) when the buffer cannot be grown."""
        skeleton, tensors = split(tree)
        specs, offset = lay_out(tensors)
        meta = metadata_bytes(skeleton, specs)
        length = offset + len(meta)
        index = self._older_buffer()
        mapping = self._mapping(index, PAYLOAD_START + length)
        mapping[:HEADER_BYTES] = INVALID
        mapping[PAYLOAD_START + offset : PAYLOAD_START + length] = meta
        with memoryview(mapping) as view, view[PAYLOAD_START : PAYLOAD_START + length] as payload:
            self._copy_from_devices(index, mapping, payload, tensors, specs)
            sources = [
                (spec.offset, copying.tensor_bytes(t.contiguous()))
                for t, spec in zip(tensors, specs)
                if not spec.cuda and spec.nbytes
            ]
            checksum = copying.copy_checksum(payload, sources, length)
            del sources
        mapping[:HEADER_BYTES] = BufferHeader(self.job, commit, length, offset, len(meta), checksum, time.time()).pack()
        return length

    def _copy_from_devices(
        self,
        index: int,
        mapping: mmap.mmap,
        payload: memoryview,
        tensors: list[torch.Tensor],
        specs: list[StoredTensor],
    ) -> None:
        """CUDA tensors go device-to-host into the buffer, asynchronously (pinned when the buffer is registered), then
        one synchronize; the checksum that follows covers their bytes too."""
        on_device = [(t, spec) for t, spec in zip(tensors, specs) if spec.cuda and spec.nbytes]
        if not on_device:
            return
        if index not in self._pinned and copying.register_pinned(mapping):
            self._pinned.add(index)
        copy_into(payload, on_device)
        torch.cuda.synchronize()

    def _older_buffer(self) -> int:
        ages = [
            (header.commit, header.written_at) if (header := self._header(i)) is not None else (0, 0.0) for i in (0, 1)
        ]
        return 0 if ages[0] <= ages[1] else 1

    def _header(self, index: int) -> BufferHeader | None:
        held = self._maps[index]
        if held is not None:
            return BufferHeader.parse(held[1][:HEADER_BYTES])
        return read_header(self.paths[index])

    def _mapping(self, index: int, size: int) -> mmap.mmap:
        """The buffer's mapping, at least `size` bytes: the file grows with posix_fallocate, so a full tmpfs fails
        here with ENOSPC instead of with SIGBUS while copying."""
        held = self._maps[index]
        if held is not None and len(held[1]) >= size:
            return held[1]
        self._unmap(index)
        path = self.paths[index]
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise SnapshotError(
                f"cannot open the host's snapshot {path}: {exc.strerror} (is the agent running?)"
            ) from None
        target = max(os.fstat(fd).st_size, -(-(size + size // 8) // _GROWTH) * _GROWTH)
        try:
            os.posix_fallocate(fd, 0, target)
        except OSError as exc:
            os.close(fd)
            free = _free_bytes(os.path.dirname(path))
            raise SnapshotError(
                f"cannot grow snapshot {path} to {target} bytes: {exc.strerror} ({free} bytes free in "
                f"{os.path.dirname(path)}); "
                "the previous commit's snapshot is intact"
            ) from None
        mapping = mmap.mmap(fd, target)
        self._maps[index] = (fd, mapping)
        return mapping

    def _unmap(self, index: int) -> None:
        held = self._maps[index]
        if held is None:
            return
        fd, mapping = held
        if index in self._pinned:
            copying.unregister_pinned(mapping)
            self._pinned.discard(index)
        mapping.close()
        os.close(fd)
        self._maps[index] = None

    def close(self) -> None:
        for index in (0, 1):
            self._unmap(index)


def read_newest(paths: Sequence[str | Path], job: str | None, reject: Reject) -> Snapshot | None:
    """The newest complete, verified snapshot among `paths` (buffers or checkpoint files), or None. `job` None accepts
    any job (a checkpoint directory); `reject(path, reason)` hears of every complete file passed over."""
    headers = [(h, str(p)) for p in paths if (h := read_header(p)) is not None]
    for header, path in sorted(headers, key=lambda hp: (hp[0].commit, hp[0].written_at), reverse=True):
        if job is not None and header.job != job:
            reject(path, f"it belongs to job {header.job!r}, not {job!r}")
            continue
        try:
            loaded = _load(path, header)
        except (OSError, ValueError) as exc:
            reject(path, f"unreadable: {exc}")
            continue
        if isinstance(loaded, str):
            reject(path, loaded)
            continue
        return loaded
    return None


def _foreign(info: os.stat_result) -> str | None:
    """Why a snapshot file is not this user's alone (its metadata may be unpickled: whoever could write it could run
    code in the job), or None."""
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != os.getuid():
        return f"it belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): another user's snapshot is not loaded"
    if info.st_mode & 0o022:
        return f"others may write it (mode {info.st_mode & 0o777:o}): chmod 600 it to resume from it"
    return None


def _load(path: str, header: BufferHeader) -> Snapshot | str:
    """The snapshot in `path`, read through one descriptor: opened without following a symlink, judged by what it
    is (`_foreign`, on the descriptor), then mapped; so nothing can be swapped in between the check and the read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        foreign = _foreign(os.fstat(fd))
        if foreign is not None:
            return foreign
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapping:
            return _from_mapping(mapping, header, path)
    finally:
        os.close(fd)


def _from_mapping(mapping: mmap.mmap, header: BufferHeader, path: str) -> Snapshot | str:
    """A mapped snapshot file verified against `header` (length, checksum), then decoded; a reason when it is not."""
    if len(mapping) < header.file_bytes:
        return f"truncated: {len(mapping)} bytes, the header says {header.file_bytes}"
    with memoryview(mapping) as view, view[PAYLOAD_START : header.file_bytes] as payload:
        checksum = copying.checksum(payload, header.payload_length)
        if checksum != header.checksum or BufferHeader.parse(view[:HEADER_BYTES].tobytes()) != header:
            return f"bad checksum (commit {header.commit}): the buffer is torn or damaged"
        try:
            skeleton, specs = _metadata(payload[header.meta_offset : header.payload_length].tobytes())
            tensors = [_tensor(payload, spec) for spec in specs]
        except (
            pickle.UnpicklingError,
            AttributeError,
            ImportError,
            KeyError,
            TypeError,
            ValueError,
            RuntimeError,
        ) as exc:
            return f"its metadata cannot be read by this version ({type(exc).__name__}: {exc})"
    return Snapshot(
        header.commit, rebuild(skeleton, tensors), header.written_at, header.payload_length, path, header.job
    )


def metadata_bytes(skeleton: Any, specs: list[StoredTensor]) -> bytes:
    return msgpack.packb([skeleton_codec.encode(skeleton), [list(spec) for spec in specs]], use_bin_type=True)


def _metadata(meta: bytes) -> tuple[Any, list[StoredTensor]]:
    """The skeleton and the tensors' places: msgpack, or a whole pickle (the first byte of one is PROTO) in a file
    written before; either is read only from a file that is the user's alone (`_foreign`)."""
    if meta[:1] == pickle.PROTO:
        loaded = cloudpickle.loads(meta)
        return loaded["skeleton"], [StoredTensor(*spec) for spec in loaded["tensors"]]
    skeleton, specs = msgpack.unpackb(meta, raw=False)
    stored = [StoredTensor(dtype, tuple(shape), offset, nbytes, cuda) for dtype, shape, offset, nbytes, cuda in specs]
    return skeleton_codec.decode(skeleton, allow_objects=True), stored


def _tensor(payload: memoryview, spec: StoredTensor) -> torch.Tensor:
    """A private copy of one tensor's bytes (never a view of the mapping, which the next commits overwrite), back on
    the current CUDA device when it was a CUDA tensor and this process has one."""
    out = torch.empty(spec.nbytes, dtype=torch.uint8)
    if spec.nbytes:
        out.numpy()[:] = np.frombuffer(payload, dtype=np.uint8, count=spec.nbytes, offset=spec.offset)
    tensor = out.view(getattr(torch, spec.dtype)).view(spec.shape)
    return (
        tensor.to(torch.device("cuda", torch.cuda.current_device()))
        if spec.cuda and torch.cuda.is_available()
        else tensor
    )


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _free_bytes(directory: str) -> int:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return -1
    return stat.f_bavail * stat.f_frsize
