"""`broadcast_tree` on real gloo groups of 2 and 3 ranks, root 1: what arrives is bit-identical to what was sent.

The root (rank 1) builds the state: a Linear + BatchNorm model's state_dict and an Adam state_dict after one step
(per-parameter `exp_avg`, a 0-dim `step`), plain values, and tensors of every dtype, gloo's refused ones included
(random bit patterns, NaN payloads too; 0-dim, zero-element and non-contiguous ones). The others pass None, or an
unrelated tree that must be ignored. Every rank returns what it ended up with, tensors encoded as (dtype, shape, raw
bytes), and the tests compare the receivers' with the root's, bit for bit. Each rank also reports the flat buffers
it broadcast, with the default cap (one per dtype) and with a cap smaller than some tensors (one tensor spans
several buffers).

On 2 ranks: the state under both caps, trees without tensor bytes (no buffers at all), and loading the result into
a fresh model and a fresh Adam (no state yet), whose next step must match the root's. On 3 ranks: the state under
the small cap, to two receivers.

The header travels as data (msgpack): a user's object in the state (a set here) arrives where the receiver's own
state holds one too; a header carrying a pickled object to a rank whose state is data only is refused before
anything is unpickled (the attack: an object whose unpickling creates a file)."""

from __future__ import annotations

import math
import pathlib
from typing import Any
from unittest import mock

import pytest
import torch

from elastic_control_plane.snapshot.tree import split
from testing.ranks import run_ranks

ROOT, SMALL_CAP = 1, 777
DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))


def _adam_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model.train()
    optimizer.zero_grad()
    model(torch.linspace(-1.0, 1.0, 8 * 64).reshape(8, 64)).pow(2).sum().backward()
    optimizer.step()


def _random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def _root_state() -> dict[str, Any]:
    """The state the root sends: a trained model and optimizer, plain values, every dtype in every layout."""
    model = _model(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _adam_step(model, optimizer)
    grid = torch.arange(20.0).reshape(4, 5)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": 3,
        "plain": ["text", (2.5, None), {"nested": True}],
        "dtypes": {
            str(dtype): {
                "full": _random_bits(dtype, (3, 5), seed),
                "scalar": _random_bits(dtype, (), seed + 100),
                "empty": _random_bits(dtype, (0, 3), seed),
            }
            for seed, dtype in enumerate(DTYPES)
        },
        "layouts": {
            "transposed": grid.t(),
            "strided": grid[::2, 1::2],
            "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
            "conjugate": _random_bits(torch.complex64, (4,), 7).conj(),
        },
    }


def _encode(tree: Any) -> tuple[Any, list[tuple[str, tuple[int, ...], bytes]], list[bool]]:
    """(skeleton, (dtype, shape, raw bytes) per tensor, contiguity per tensor): bit-level content, picklable."""
    skeleton, tensors = split(tree)
    encoded = [
        (str(t.dtype), tuple(t.shape), t.resolve_conj().reshape(-1).view(torch.uint8).numpy().tobytes())
        for t in tensors
    ]
    return skeleton, encoded, [t.is_contiguous() for t in tensors]


def _send(tree: Any, buffer_bytes: int | None = None) -> tuple[Any, list[int]]:
    """broadcast_tree from ROOT, and the sizes in bytes of the flat buffers it broadcast."""
    from libworker.elastic import transfer

    sizes: list[int] = []
    original = transfer.broadcast_async_

    def counted(tensor: torch.Tensor, root_rank: int) -> int:
        sizes.append(tensor.numel() * tensor.element_size())
        return original(tensor, root_rank)

    with mock.patch.object(transfer, "broadcast_async_", counted):
        options = {} if buffer_bytes is None else {"buffer_bytes": buffer_bytes}
        return transfer.broadcast_tree(tree, ROOT, **options), sizes


def _body_pair() -> dict[str, Any]:
    """Rank 1 sends, rank 0 receives: the state under both caps, trees without tensor bytes, then every rank loads
    the state it has into a fresh model and Adam and takes one step."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = _root_state() if rank == ROOT else None
    out: dict[str, Any] = {}
    state, out["buffers"] = _send(mine)
    out["state"], out["metadata"] = _encode(state), state["model"]._metadata
    out["root_got_its_tree"] = state is mine
    split_state, out["split_buffers"] = _send(mine, SMALL_CAP)
    out["split_state"] = _encode(split_state)
    plain = {"epoch": 4, "items": [1, (2, "three")]} if rank == ROOT else None
    out["no_tensors"] = _send(plain)
    empty = {"a": torch.empty(0, 3), "b": [torch.empty(0, dtype=torch.int64)]} if rank == ROOT else None
    empty_state, out["empty_buffers"] = _send(empty)
    out["empty_state"] = _encode(empty_state)

    model = _model(100 + rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    out["fresh_had_state"] = bool(optimizer.state_dict()["state"])
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    out["loaded"] = _encode({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    _adam_step(model, optimizer)
    out["after_step"] = _encode({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    return out


def _body_three() -> dict[str, Any]:
    """Rank 1 sends under the small cap to ranks 0 and 2; rank 2 passes an unrelated tree, which must be ignored."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = _root_state() if rank == ROOT else (None if rank == 0 else {"unrelated": torch.ones(9)})
    state, buffers = _send(mine, SMALL_CAP)
    return {"state": _encode(state), "buffers": buffers}


class Planted:
    """What a hostile root sends: unpickling it creates `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def _body_objects(planted: str) -> dict[str, Any]:
    """Rank 1 sends a state holding a set to a rank whose state holds a set too, then a state holding a planted
    object to a rank whose state is data only (no tensors: the root does not wait for the refusing rank)."""
    import torch.distributed as dist

    from elastic_control_plane.snapshot.skeleton_codec import ObjectRefused

    root = dist.get_rank() == ROOT
    seen, _ = _send({"seen": {1, 2} if root else set(), "weights": torch.arange(4.0) if root else torch.zeros(4)})
    out: dict[str, Any] = {"seen": seen["seen"], "weights": seen["weights"].tolist()}
    try:
        _send({"epoch": 7, "note": Planted(planted) if root else None})
        out["planted"] = "accepted"
    except ObjectRefused as refused:
        out["planted"] = f"refused: {refused}"
    return out


def test_a_users_object_arrives_where_the_receiver_holds_one_and_a_planted_one_is_refused(
    tmp_path: pathlib.Path,
) -> None:
    planted = tmp_path / "planted"
    outcomes = run_ranks(2, _body_objects, str(planted), timeout=120)
    receiver = outcomes[1 - ROOT]
    assert (receiver["seen"], receiver["weights"]) == ({1, 2}, [0.0, 1.0, 2.0, 3.0])
    assert receiver["planted"].startswith("refused: "), receiver["planted"]
    assert outcomes[ROOT]["planted"] == "accepted", "the root sends; only the receiver judges"
    assert not planted.exists(), "nothing of the planted object ran"


@pytest.fixture(scope="module")
def pair() -> list[dict[str, Any]]:
    return run_ranks(2, _body_pair, timeout=120)


@pytest.fixture(scope="module")
def three() -> list[dict[str, Any]]:
    return run_ranks(3, _body_three, timeout=120)


def _receivers(outcomes: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    return [(rank, out) for rank, out in enumerate(outcomes) if rank != ROOT]


def _assert_same(actual: tuple[Any, Any, list[bool]], expected: tuple[Any, Any, list[bool]], label: str) -> None:
    """`actual` holds the same tensors as `expected`, bit for bit, each contiguous."""
    assert actual[0] == expected[0], f"{label}: the tree's structure or plain values differ"
    assert len(actual[1]) == len(expected[1]), f"{label}: {len(actual[1])} tensors, the root sent {len(expected[1])}"
    for index, (got, want) in enumerate(zip(actual[1], expected[1])):
        assert got[:2] == want[:2], f"{label}: tensor {index} is {got[:2]}, the root's is {want[:2]}"
        assert got[2] == want[2], f"{label}: tensor {index} ({want[0]}, {want[1]}) is not bit-identical to the root's"
    assert all(actual[2]), f"{label}: some received tensors are not contiguous"


def _group_bytes(encoded: tuple[Any, list[tuple[str, tuple[int, ...], bytes]], list[bool]]) -> list[int]:
    """Bytes per dtype (all of these tensors are on CPU), in order of first appearance."""
    groups: dict[str, int] = {}
    for dtype, _, raw in encoded[1]:
        groups[dtype] = groups.get(dtype, 0) + len(raw)
    return list(groups.values())


def _small_buffers(encoded: tuple[Any, list[tuple[str, tuple[int, ...], bytes]], list[bool]]) -> list[int]:
    """The buffer sizes the small cap cuts each dtype's bytes into."""
    return [min(SMALL_CAP, nbytes - start) for nbytes in _group_bytes(encoded) for start in range(0, nbytes, SMALL_CAP)]


def test_the_receiver_gets_the_roots_state_bit_identical(pair: list[dict[str, Any]]) -> None:
    root = pair[ROOT]
    assert root["root_got_its_tree"], "the root did not get its own tree back"
    assert not all(root["state"][2]), "the root's state should include non-contiguous tensors"
    assert set(root["state"][0]["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    for rank, out in _receivers(pair):
        _assert_same(out["state"], root["state"], f"rank {rank}")
        assert out["metadata"] == root["metadata"], f"rank {rank}: the model state_dict's _metadata was lost"


def test_every_dtype_and_layout_arrives(pair: list[dict[str, Any]]) -> None:
    dtypes = {dtype for dtype, _, _ in pair[ROOT]["state"][1]}
    assert {str(dtype) for dtype in DTYPES} <= dtypes
    shapes = {shape for _, shape, _ in pair[ROOT]["state"][1]}
    assert {(), (0, 3), (3, 5), (5, 4), (2, 2), (3, 2)} <= shapes
    for rank, out in _receivers(pair):
        received = {(dtype, shape) for dtype, shape, _ in out["state"][1]}
        assert received == {(dtype, shape) for dtype, shape, _ in pair[ROOT]["state"][1]}, f"rank {rank}"


def test_one_buffer_per_dtype_under_the_default_cap(pair: list[dict[str, Any]]) -> None:
    expected = [nbytes for nbytes in _group_bytes(pair[ROOT]["state"]) if nbytes]
    for rank, out in enumerate(pair):
        assert out["buffers"] == expected, f"rank {rank}: buffers {out['buffers']}, expected one per dtype {expected}"


def test_a_small_cap_splits_groups_and_tensors_into_several_buffers(pair: list[dict[str, Any]]) -> None:
    root = pair[ROOT]
    assert max(len(raw) for _, _, raw in root["state"][1]) > SMALL_CAP, "no tensor is larger than the cap"
    expected = _small_buffers(root["state"])
    for rank, out in enumerate(pair):
        assert out["split_buffers"] == expected, (
            f"rank {rank}: buffers of {out['split_buffers']} bytes, expected {expected}"
        )
        if rank != ROOT:
            _assert_same(out["split_state"], root["state"], f"rank {rank}, cap {SMALL_CAP}")


def test_trees_without_tensor_bytes_send_no_buffers(pair: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(pair):
        assert out["no_tensors"] == ({"epoch": 4, "items": [1, (2, "three")]}, []), f"rank {rank}: {out['no_tensors']}"
        assert out["empty_buffers"] == [], f"rank {rank}: zero-element tensors sent buffers {out['empty_buffers']}"
        _assert_same(out["empty_state"], pair[ROOT]["empty_state"], f"rank {rank}, zero-element tensors")


def test_the_result_loads_into_a_fresh_model_and_optimizer(pair: list[dict[str, Any]]) -> None:
    root = pair[ROOT]
    assert root["loaded"][1], "nothing was loaded"
    assert any(shape == () and dtype == "torch.float32" for dtype, shape, _ in root["loaded"][1]), (
        "Adam's 0-dim step is missing"
    )
    for rank, out in _receivers(pair):
        assert not out["fresh_had_state"], f"rank {rank}: the fresh optimizer already had state"
        _assert_same(out["loaded"], root["loaded"], f"rank {rank}, loaded")
        _assert_same(out["after_step"], root["after_step"], f"rank {rank}, after one more Adam step")


def test_three_ranks_each_receive_the_state_in_small_buffers(three: list[dict[str, Any]]) -> None:
    root = three[ROOT]
    expected = _small_buffers(root["state"])
    for rank, out in enumerate(three):
        assert out["buffers"] == expected, f"rank {rank}: buffers of {out['buffers']} bytes, expected {expected}"
        if rank != ROOT:
            _assert_same(out["state"], root["state"], f"rank {rank} of 3")
