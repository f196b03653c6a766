"""What ranks agree on before a collective's data moves (`Signature`), and how a disagreement is worded.

A `Signature` is what one rank is about to do: the operation's kind, its
tensors' dtypes and shapes, reduce op, root, scale factors and device; it
travels as a plain list (`to_wire`). `mismatch` names the first field in which
the ranks' signatures differ, with every rank's value, as Horovod's
coordinator words it ("Mismatched allreduce tensor shapes: rank 0 has [17,
17], rank 1 has [18, 17]"). libworker.negotiation exchanges and caches them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

OP_LABELS = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product", -1: "none"}


@dataclass(frozen=True)
class TensorSignature:
    """One tensor's part of a Signature: its dtype and shape."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Signature:
    """What a rank is about to do; ranks must agree on all of it. For allgather and alltoall `shape` leaves out
    the first dimension, which may differ."""

    kind: str
    tensors: tuple[TensorSignature, ...] = ()
    op: int = -1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    device: str = "cpu"

    def to_wire(self) -> list[Any]:
        return [
            self.kind,
            [[t.dtype, list(t.shape)] for t in self.tensors],
            self.op,
            self.root,
            self.prescale,
            self.postscale,
            self.device,
        ]

    @classmethod
    def from_wire(cls, wire: list[Any]) -> Signature:
        kind, tensors, op, root, prescale, postscale, device = wire
        return cls(kind, tuple(TensorSignature(d, tuple(s)) for d, s in tensors), op, root, prescale, postscale, device)


def tensor_signature(tensor: torch.Tensor, skip_first: bool = False) -> TensorSignature:
    shape = tuple(tensor.shape)
    return TensorSignature(str(tensor.dtype).removeprefix("torch."), shape[1:] if skip_first else shape)


def _describe(values: dict[int, Any]) -> str:
    """`rank 0 has X, rank 1 has Y` (ranks with the same value grouped)."""
    groups: dict[str, list[int]] = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(str(value), []).append(rank)
    return ", ".join(
        f"rank {ranks[0]} has {value}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} have {value}"
        for value, ranks in groups.items()
    )


def mismatch(signatures: dict[int, Signature]) -> str | None:
    """The first field the ranks' signatures disagree on, as Horovod words it with every rank's value; None if equal."""
    first = next(iter(signatures.values()))
    if all(s == first for s in signatures.values()):
        return None
    kind = first.kind
    checks: list[tuple[str, Callable[[Signature], Any]]] = [
        ("operations", lambda s: s.kind),
        (f"{kind} CPU/GPU device selection", lambda s: s.device),
        (f"{kind} number of tensors", lambda s: len(s.tensors)),
        (f"{kind} data types", lambda s: ", ".join(t.dtype for t in s.tensors)),
        (
            f"{kind} tensor shapes" + (" (after the first dimension)" if kind in ("allgather", "alltoall") else ""),
            lambda s: "; ".join(str(list(t.shape)) for t in s.tensors),
        ),
        (f"{kind} reduction operation", lambda s: OP_LABELS.get(s.op, s.op)),
        (f"{kind} root ranks", lambda s: s.root),
        (f"{kind} prescale and/or postscale factors", lambda s: (s.prescale, s.postscale)),
    ]
    for label, value in checks:
        values = {rank: value(s) for rank, s in signatures.items()}
        if len(set(map(str, values.values()))) > 1:
            return f"Mismatched {label}: {_describe(values)}"
    return f"Mismatched {kind}: {_describe(signatures)}"
