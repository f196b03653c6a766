"""A state's skeleton as data (snapshot/skeleton_codec.py): what a real model and optimizer's state holds comes back
equal, with its types, without pickle; a user's own object is pickled and read back only where allowed; bytes that
are not a skeleton, or that smuggle objects in as numpy data, are refused with a reason."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import msgpack
import numpy
import pytest
import torch

from elastic_control_plane.snapshot import skeleton_codec
from elastic_control_plane.snapshot.skeleton_codec import NotASkeleton, ObjectRefused, decode, encode, holds_objects
from elastic_control_plane.snapshot.tree import split


class Touch:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return Path.touch, (self.path,)


def _state() -> Any:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": 3,
        "plain": ["text", (2.5, None, b"raw"), {"nested": True, 7: "int key", (1, 2): "tuple key"}],
        "big": 2**80,
        "dtype": torch.bfloat16,
        "numpy": {"best": numpy.float64(0.25), "steps": numpy.int64(9), "rng": numpy.random.RandomState(0).get_state()},
    }


def test_a_models_and_optimizers_state_comes_back_equal_with_its_types_and_no_pickle() -> None:
    skeleton, tensors = split(_state())
    assert tensors and not holds_objects(skeleton)
    back = decode(encode(skeleton), allow_objects=False)
    assert type(back["model"]) is collections.OrderedDict
    assert back["model"]._metadata == skeleton["model"]._metadata, "load_state_dict reads the module versions"
    assert back["plain"] == skeleton["plain"] and type(back["plain"][1]) is tuple
    assert (back["big"], back["dtype"], back["epoch"]) == (2**80, torch.bfloat16, 3)
    assert type(back["numpy"]["best"]) is numpy.float64 and back["numpy"]["best"] == 0.25
    rng, sent = back["numpy"]["rng"], skeleton["numpy"]["rng"]
    assert rng[0] == sent[0] and numpy.array_equal(rng[1], sent[1]) and rng[1].dtype == numpy.uint32
    assert back["optimizer"]["param_groups"] == skeleton["optimizer"]["param_groups"]
    assert back["model"].keys() == skeleton["model"].keys()


def test_a_users_object_is_pickled_and_read_back_only_where_allowed(tmp_path: Path) -> None:
    skeleton = {"seen": {1, 2}, "epoch": 1}
    assert holds_objects(skeleton)
    assert decode(encode(skeleton), allow_objects=True) == skeleton
    planted = tmp_path / "planted"
    with pytest.raises(ObjectRefused, match="holds only data"):
        decode(encode({"epoch": 1, "note": Touch(planted)}), allow_objects=False)
    assert not planted.exists()


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"\xc1", "not a skeleton"),
        (msgpack.packb(msgpack.ExtType(99, b"")), "ext type 99"),
        (msgpack.packb(msgpack.ExtType(skeleton_codec.EXT_DTYPE, msgpack.packb("system"))), "ext type"),
        (msgpack.packb(msgpack.ExtType(skeleton_codec.EXT_NUMPY, msgpack.packb(["|O", [1], b"\0" * 8, False]))), "|O"),
        (msgpack.packb({(1,): 2}) + b"junk", "not a skeleton"),
    ],
    ids=["not-msgpack", "unknown-ext", "not-a-dtype", "numpy-objects", "trailing-bytes"],
)
def test_bytes_that_are_not_a_skeleton_are_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(NotASkeleton, match="not a skeleton") as refused:
        decode(data, allow_objects=True)
    assert reason in str(refused.value)
