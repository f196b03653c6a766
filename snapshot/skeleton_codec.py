"""A state tree's skeleton (snapshot/tree.py) as data: msgpack, so reading one runs no code of the sender's.

msgpack carries None, bools, 64-bit ints, floats, strings, bytes, lists and
dicts as they are; ext types carry the rest of what a skeleton holds: a tuple,
an OrderedDict (a state_dict, with its `_metadata`), a TensorRef, a torch
dtype, an int wider than 64 bits, a numpy array or scalar of numbers, text or
times. Anything else is the user's own object (a set, a class of theirs): it is
pickled inside the skeleton, and `decode` unpickles it only where the caller
allows objects. The state sync allows them only on a rank whose own state
holds an object too (`holds_objects`): a state of tensors and plain values,
the usual one, is never unpickled, whoever reaches the job's process group.
"""

from __future__ import annotations

import collections
from typing import Any

import cloudpickle
import msgpack
import numpy
import torch

from elastic_control_plane.snapshot.tree import TensorRef

EXT_TUPLE, EXT_ORDERED_DICT, EXT_TENSOR_REF, EXT_DTYPE, EXT_BIG_INT, EXT_OBJECT, EXT_NUMPY = range(1, 8)
KNOWN_EXT = range(1, 8)
INT_RANGE = range(-(2**63), 2**64)
PLAIN = (type(None), bool, str, bytes, float)
NUMPY_DATA_KINDS = "biufcmMUS"  # numpy's bool, ints, floats, complex, times, text: no objects, no structured dtypes


class NotASkeleton(ValueError):
    """The bytes are not a skeleton `encode` wrote."""


class ObjectRefused(ValueError):
    """The skeleton carries a pickled object where the caller allows data only."""


def encode(skeleton: Any) -> bytes:
    return msgpack.packb(_data(skeleton), use_bin_type=True)


def decode(data: bytes, allow_objects: bool) -> Any:
    """The skeleton `encode` wrote. ObjectRefused: it holds a pickled object and `allow_objects` is False;
    NotASkeleton: the bytes are not one."""

    def ext_hook(code: int, payload: bytes) -> Any:
        if code == EXT_OBJECT:
            if not allow_objects:
                raise ObjectRefused("the state sent holds a pickled object where this rank's own state holds only data")
            return cloudpickle.loads(payload)
        if code not in KNOWN_EXT:
            raise NotASkeleton(f"not a skeleton: ext type {code}")
        inner = _unpack(payload, ext_hook)
        if code == EXT_TUPLE and isinstance(inner, list):
            return tuple(inner)
        if code == EXT_ORDERED_DICT and isinstance(inner, list) and len(inner) == 2:
            items, metadata = inner
            mapping = collections.OrderedDict(items)
            if metadata is not None:
                mapping._metadata = metadata  # type: ignore[attr-defined]
            return mapping
        if code == EXT_TENSOR_REF and isinstance(inner, int) and inner >= 0:
            return TensorRef(inner)
        if code == EXT_DTYPE and isinstance(inner, str) and isinstance(getattr(torch, inner, None), torch.dtype):
            return getattr(torch, inner)
        if code == EXT_BIG_INT and isinstance(inner, str):
            return int(inner)
        if code == EXT_NUMPY and isinstance(inner, list) and len(inner) == 4:
            return _numpy(*inner)
        raise NotASkeleton(f"not a skeleton: ext type {code} holding {type(inner).__name__}")

    return _unpack(data, ext_hook)


def holds_objects(skeleton: Any) -> bool:
    """Does the skeleton hold anything `encode` must pickle?"""
    kind = type(skeleton)
    if kind in PLAIN or kind in (int, TensorRef) or isinstance(skeleton, torch.dtype) or _numpy_data(skeleton):
        return False
    if kind in (list, tuple):
        return any(holds_objects(item) for item in skeleton)
    if kind in (dict, collections.OrderedDict):
        return any(holds_objects(key) or holds_objects(value) for key, value in skeleton.items())
    return True


def _data(node: Any) -> Any:
    """`node` as msgpack's own types and ext types."""
    kind = type(node)
    if kind in PLAIN:
        return node
    if kind is int:
        return node if node in INT_RANGE else _ext(EXT_BIG_INT, str(node))
    if kind is list:
        return [_data(item) for item in node]
    if kind is dict:
        return {_data(key): _data(value) for key, value in node.items()}
    if kind is tuple:
        return _ext(EXT_TUPLE, [_data(item) for item in node])
    if kind is collections.OrderedDict:
        metadata = getattr(node, "_metadata", None)
        return _ext(EXT_ORDERED_DICT, [[[_data(k), _data(v)] for k, v in node.items()], _data(metadata)])
    if kind is TensorRef:
        return _ext(EXT_TENSOR_REF, node.index)
    if isinstance(node, torch.dtype):
        return _ext(EXT_DTYPE, str(node).removeprefix("torch."))
    if _numpy_data(node):
        array = numpy.asarray(node)
        return _ext(EXT_NUMPY, [array.dtype.str, list(array.shape), array.tobytes(), isinstance(node, numpy.generic)])
    return msgpack.ExtType(EXT_OBJECT, cloudpickle.dumps(node))


def _numpy_data(node: Any) -> bool:
    return isinstance(node, (numpy.ndarray, numpy.generic)) and node.dtype.kind in NUMPY_DATA_KINDS


def _numpy(dtype: Any, shape: Any, data: Any, scalar: Any) -> Any:
    """The numpy array (or scalar) `_data` sent: numbers, text or times only, never objects."""
    kind = numpy.dtype(dtype) if isinstance(dtype, str) else None
    if kind is None or kind.kind not in NUMPY_DATA_KINDS or not isinstance(data, bytes):
        raise NotASkeleton(f"not a skeleton: numpy data of dtype {dtype!r}")
    array = numpy.frombuffer(data, dtype=kind).reshape(shape).copy()
    return array[()] if scalar is True else array


def _ext(code: int, inner: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(inner, use_bin_type=True))


def _unpack(data: bytes, ext_hook: Any) -> Any:
    try:
        return msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False, use_list=True)
    except (NotASkeleton, ObjectRefused):
        raise
    except Exception as exc:  # msgpack's own (not msgpack at all), an unhashable key, a malformed item list
        raise NotASkeleton(f"not a skeleton: {type(exc).__name__} {exc}".rstrip()) from None
