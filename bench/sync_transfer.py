"""State sync's transfer: `broadcast_tree` (flat buffers) against `broadcast_object` (one pickle) of the same state.

    python -m bench.sync_transfer [--mib 64] [--ranks 2]

Ranks of a real gloo group on loopback (`tests/sockets/ranks.py`, no control
plane). Rank 0 holds the state TorchState.sync sends: an MLP's state_dict
and its Adam state_dict after one step (parameters, exp_avg and exp_avg_sq:
about `--mib` MiB in all); the others receive it, passing None. Each way is
timed from a barrier to a barrier after the transfer (rank 0's clock, so the
time includes the slowest receiver's unpacking), best of 3. The ratio is
pickled / flat (above 1.0: flat buffers are faster). The last line is
`SYNC mib=... flat_s=... pickled_s=... ratio=...`. On a shared machine single
runs vary: compare ratios, not absolute times. Both ways write the received
state into fresh memory; in a VM its page faults cost as much as the transfer
(a raw gloo broadcast of 256 MiB into a fresh tensor is 3-5x one into a
tensor already written).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from elastic_control_plane.snapshot.tree import split
from testing.ranks import run_ranks

LAYERS, TRIES = 8, 3


def _state(mib: float) -> dict[str, Any]:
    """A model and its Adam state of about `mib` MiB: LAYERS square Linear layers, three float32 copies of each."""
    width = max(1, round(math.sqrt(mib * (1 << 20) / (3 * 4 * LAYERS))))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(LAYERS)))
    optimizer = torch.optim.Adam(model.parameters())
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}


def _best_time(send: Callable[[], Any]) -> float:
    from libworker.mpi_ops import barrier

    times = []
    for _ in range(TRIES):
        barrier()
        start = time.perf_counter()
        send()
        barrier()
        times.append(time.perf_counter() - start)
    return min(times)


def _rank_body(mib: float) -> dict[str, float]:
    """Both ways on this rank; rank 0 sends. Returns the best times and the state's size in MiB."""
    import torch.distributed as dist

    from libworker.elastic.transfer import broadcast_tree
    from libworker.functions import broadcast_object

    state = _state(mib) if dist.get_rank() == 0 else None
    size = sum(t.numel() * t.element_size() for t in split(state)[1])
    return {
        "flat_s": _best_time(lambda: broadcast_tree(state, 0)),
        "pickled_s": _best_time(lambda: broadcast_object(state, 0)),
        "mib": size / (1 << 20),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=64.0, help="Size of the model + Adam state, MiB.")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    root = run_ranks(args.ranks, _rank_body, args.mib, timeout=600)[0]
    flat, pickled = root["flat_s"], root["pickled_s"]
    print(f"state of {root['mib']:.1f} MiB, {args.ranks} ranks, gloo over loopback, best of {TRIES}")
    print(f"flat buffers (broadcast_tree):  {flat:.3f} s  {root['mib'] / flat:8.1f} MiB/s")
    print(f"pickled (broadcast_object):     {pickled:.3f} s  {root['mib'] / pickled:8.1f} MiB/s")
    print(f"SYNC mib={root['mib']:.1f} flat_s={flat:.3f} pickled_s={pickled:.3f} ratio={pickled / flat:.2f}")


if __name__ == "__main__":
    main()
