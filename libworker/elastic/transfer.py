"""Broadcast a state tree (nested dicts, lists and tuples of tensors and plain values) without pickling tensor data.

The root splits the tree (`snapshot.tree.split`) and sends a header: the
skeleton, one `SentTensor` per tensor and the buffer size, as data (msgpack:
snapshot/skeleton_codec.py; a rank unpickles a user's object in it only where
its own state holds one too, so nothing is unpickled for a state of tensors and
plain values). Every rank then plans the same transfer from the specs: the tensors are
grouped by (dtype, CPU or CUDA), each group laid out end to end as one flat
run of bytes, cut into buffers of at most `buffer_bytes` (the root's;
BUFFER_BYTES by default); each buffer is one `broadcast_async_`. Buffers
travel as uint8 byte views: a broadcast moves bytes, and bytes are a dtype
every backend takes (gloo refuses int16, the unsigned ints wider than a byte
and the float8 types), so every dtype arrives bit-identical.

The root copies each buffer out of its tensors just before sending it and
waits for the oldest once more than `IN_FLIGHT_BUFFERS` are in flight: its
extra memory is IN_FLIGHT_BUFFERS + 1 buffers (plus a contiguous copy of a
non-contiguous tensor while it is packed), not the state's size. A receiver
allocates one flat tensor per group (on the current CUDA device for CUDA
tensors), receives the buffers straight into it, and gets its tensors back
as contiguous views of it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from elastic_control_plane.snapshot import skeleton_codec
from elastic_control_plane.snapshot.tree import rebuild, split
from libworker.mpi_ops import broadcast_, broadcast_async_, synchronize
from libworker.world import require_joined

BUFFER_BYTES = 64 << 20
IN_FLIGHT_BUFFERS = 2


@dataclass(frozen=True)
class SentTensor:
    """What a receiver needs to rebuild one tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    cuda: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class _Group:
    """Tensors of one dtype and device kind, laid out end to end: (tensor index, byte offset) per member."""

    dtype: torch.dtype
    cuda: bool
    members: list[tuple[int, int]] = field(default_factory=list)
    nbytes: int = 0


def broadcast_tree(tree: Any, root_rank: int, buffer_bytes: int = BUFFER_BYTES) -> Any:
    """root_rank's `tree` on every rank; the root gets its own tree back, the others' `tree` is ignored.

    Collective: every rank of the round calls it with the same root. The
    root's `buffer_bytes` applies everywhere. Raises WorkerInternalError when
    a peer fails or the round is aborted.
    """
    require_joined()
    is_root = dist.get_rank() == root_rank
    skeleton, tensors = split(tree)
    if is_root:
        specs = [SentTensor(t.dtype, tuple(t.shape), t.is_cuda) for t in tensors]
        _broadcast_bytes(_encode_header(skeleton, specs, int(buffer_bytes)), root_rank)
    else:
        allow_objects = skeleton_codec.holds_objects(skeleton)
        skeleton, specs, buffer_bytes = _decode_header(_broadcast_bytes(b"", root_rank), allow_objects)
    groups = _plan(specs)
    if is_root:
        _send_all(_packed_buffers(groups, specs, tensors, buffer_bytes), root_rank)
        return tree
    flats = [
        torch.empty(group.nbytes // group.dtype.itemsize, dtype=group.dtype, device=_device(group.cuda))
        for group in groups
    ]
    _send_all(_receiving_buffers(flats, buffer_bytes), root_rank)
    return rebuild(skeleton, _views(groups, flats, specs))


def _encode_header(skeleton: Any, specs: list[SentTensor], buffer_bytes: int) -> bytes:
    sent = [[str(spec.dtype).removeprefix("torch."), list(spec.shape), spec.cuda] for spec in specs]
    return msgpack.packb([skeleton_codec.encode(skeleton), sent, buffer_bytes], use_bin_type=True)


def _decode_header(header: bytes, allow_objects: bool) -> tuple[Any, list[SentTensor], int]:
    """The root's skeleton, tensor specs and buffer size. ValueError: the header is not one."""
    try:
        skeleton, sent, buffer_bytes = msgpack.unpackb(header, raw=False)
        specs = [SentTensor(_dtype(dtype), tuple(int(n) for n in shape), bool(cuda)) for dtype, shape, cuda in sent]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the state sync's header cannot be read: {exc}") from None
    if not isinstance(buffer_bytes, int) or buffer_bytes < 1:
        raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
    if any(n < 0 for spec in specs for n in spec.shape):
        raise ValueError("the state sync's header names a tensor of negative size")
    return skeleton_codec.decode(skeleton, allow_objects), specs, buffer_bytes


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _broadcast_bytes(data: bytes, root_rank: int) -> bytes:
    """root_rank's `data` on every rank (the others' is ignored): its length, then its bytes."""
    length = torch.tensor([len(data)], dtype=torch.int64)
    broadcast_(length, root_rank)
    if dist.get_rank() == root_rank:
        broadcast_(torch.frombuffer(bytearray(data), dtype=torch.uint8), root_rank)
        return data
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank)
    return payload.numpy().tobytes()


def _plan(specs: list[SentTensor]) -> list[_Group]:
    """The groups, in order of their first tensor: the same on every rank, since all plan from the root's specs."""
    groups: dict[tuple[torch.dtype, bool], _Group] = {}
    for index, spec in enumerate(specs):
        group = groups.setdefault((spec.dtype, spec.cuda), _Group(spec.dtype, spec.cuda))
        group.members.append((index, group.nbytes))
        group.nbytes += spec.nbytes
    return list(groups.values())


def _views(groups: list[_Group], flats: list[torch.Tensor], specs: list[SentTensor]) -> list[torch.Tensor]:
    """Each received tensor, in the root's order, as a contiguous view of its group's flat tensor."""
    views: dict[int, torch.Tensor] = {}
    for group, flat in zip(groups, flats):
        for index, offset in group.members:
            start, spec = offset // group.dtype.itemsize, specs[index]
            views[index] = flat[start : start + math.prod(spec.shape)].view(spec.shape)
    return [views[index] for index in range(len(specs))]


def _device(cuda: bool) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a flat run of bytes (a copy only when it is not contiguous)."""
    return tensor.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)


def _packed_buffers(
    groups: list[_Group], specs: list[SentTensor], tensors: list[torch.Tensor], buffer_bytes: int
) -> Iterator[torch.Tensor]:
    """The root's buffers, each filled from the tensors it covers when the transfer asks for it."""
    for group in groups:
        device = _device(group.cuda)
        for start in range(0, group.nbytes, buffer_bytes):
            end = min(start + buffer_bytes, group.nbytes)
            buffer = torch.empty(end - start, dtype=torch.uint8, device=device)
            for index, offset in group.members:
                low, high = max(offset, start), min(offset + specs[index].nbytes, end)
                if low < high:
                    buffer[low - start : high - start].copy_(_as_bytes(tensors[index])[low - offset : high - offset])
            yield buffer


def _receiving_buffers(flats: list[torch.Tensor], buffer_bytes: int) -> Iterator[torch.Tensor]:
    """A receiver's buffers: byte slices of its flat tensors, cut as the root cuts its groups."""
    for flat in flats:
        data = flat.view(torch.uint8)
        for start in range(0, data.numel(), buffer_bytes):
            yield data[start : start + buffer_bytes]


def _send_all(buffers: Iterator[torch.Tensor], root_rank: int) -> None:
    """Broadcast each buffer in order, waiting for the oldest whenever more than IN_FLIGHT_BUFFERS are in flight."""
    pending: deque[int] = deque()
    for buffer in buffers:
        pending.append(broadcast_async_(buffer, root_rank))
        if len(pending) > IN_FLIGHT_BUFFERS:
            synchronize(pending.popleft())
    while pending:
        synchronize(pending.popleft())
