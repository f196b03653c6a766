"""A state tree (nested dicts, lists and tuples of tensors and plain values) split into a skeleton and its tensors.

The skeleton holds everything but the tensors, each replaced by a `TensorRef`
naming its place in the tensor list; it is small and picklable. Snapshots store
the tensors as raw bytes and sync sends them as flat buffers: neither pickles
tensor data. Mappings keep their class and a state_dict's `_metadata` (module
versions that `load_state_dict` reads).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorRef:
    index: int


def split(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """(skeleton, tensors): `rebuild(skeleton, tensors)` rebuilds the tree."""
    tensors: list[torch.Tensor] = []
    return _split(tree, tensors), tensors


def _split(node: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        tensors.append(node.detach())
        return TensorRef(len(tensors) - 1)
    if isinstance(node, Mapping):
        return _same_mapping(node, {key: _split(value, tensors) for key, value in node.items()})
    if type(node) in (list, tuple):
        return type(node)(_split(item, tensors) for item in node)
    return node


def rebuild(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The tree that `split` took apart: each TensorRef of the skeleton replaced by its tensor."""
    if isinstance(skeleton, TensorRef):
        return tensors[skeleton.index]
    if isinstance(skeleton, Mapping):
        return _same_mapping(skeleton, {key: rebuild(value, tensors) for key, value in skeleton.items()})
    if type(skeleton) in (list, tuple):
        return type(skeleton)(rebuild(item, tensors) for item in skeleton)
    return skeleton


def _same_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    try:
        rebuilt = type(original)(items)
    except TypeError:
        rebuilt = dict(items)
    metadata = getattr(original, "_metadata", None)
    if metadata is not None:
        rebuilt._metadata = metadata  # type: ignore[attr-defined]
    return rebuilt
