"""Run a function on N ranks of a real gloo process group on loopback, with libworker's world set up as a round
would set it, without the control plane: the tier that checks collectives' numbers against a single-process
reference. Each rank's return value (picklable) comes back to the test, in rank order."""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from testing.harness import free_ports


def _rank_main(func: Callable[..., Any], rank: int, size: int, port: int, args: tuple[Any, ...], results: Any) -> None:
    import torch.distributed as dist

    from libworker.world import world

    try:
        world.slot = {
            "rank": rank,
            "size": size,
            "local_rank": rank,
            "local_size": size,
            "cross_rank": 0,
            "cross_size": 1,
            "round": 1,
            "hosts_timestamp": 0.0,
            "hostname": "h",
        }
        world.round, world.backend = 1, "gloo"
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=30))
        results.put((rank, "ok", func(*args)))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


def _context() -> multiprocessing.context.ForkServerContext:
    """Ranks are forked from a server that imported torch and libworker once and ran nothing else (no thread, no
    OpenMP pool to fork): each rank starts in milliseconds instead of importing torch again."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "libworker", "testing.ranks"])
    return context


def run_ranks(size: int, func: Callable[..., Any], *args: Any, timeout: float = 60.0) -> list[Any]:
    """Start `size` processes, run `func(*args)` on each after joining a gloo group, return their results."""
    context = _context()
    results = context.Queue()
    port = free_ports(1)[0]
    processes = [
        context.Process(target=_rank_main, args=(func, rank, size, port, args, results)) for rank in range(size)
    ]
    for process in processes:
        process.start()
    try:
        collected: dict[int, Any] = {}
        errors = []
        for _ in range(size):
            rank, outcome, value = results.get(timeout=timeout)
            if outcome == "error":
                errors.append(f"rank {rank}:\n{value}")
            collected[rank] = value
        assert not errors, "\n".join(errors)
        return [collected[rank] for rank in range(size)]
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
