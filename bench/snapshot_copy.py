"""Snapshot copy throughput (issue 9): committed tensors into a shared-memory file, with and without the native
extension.

    python -m bench.snapshot_copy [--mib 192]

The state is a model plus Adam (parameters, exp_avg, exp_avg_sq: a third of
`--mib` each, 99 float32 tensors of mixed sizes). The destination is an
mmap of a file in /dev/shm, pre-allocated with posix_fallocate and removed on
the way out; tensors lie at 64-byte aligned offsets as in a snapshot buffer.
Each way is timed best of 5 after one warm-up:

    clone            tensor.clone() of every tensor (what a plain in-memory commit costs)
    torch copy_      dst_view.copy_(tensor) into the mmap
    numpy+zlib 1t    np.copyto per tensor, then one zlib.crc32 over the region, one thread
    python path      copying.python_copy_checksum (thread pool over chunks)
    native           copying.native_copy_checksum (fused copy + CRC per chunk)
    native checksum  copying.native_checksum alone (what verifying before a restore costs)
    python checksum  copying.python_checksum alone

One line each with GB/s and the speed ratio to clone and to the Python path;
the last line is `SNAPCOPY mib=... native_gbps=... python_gbps=...
clone_gbps=... native_vs_clone=...`.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from elastic_control_plane.snapshot import copying

ALIGN = 64


def _model(mib: int) -> list[torch.Tensor]:
    """Parameters of mixed sizes (big matrices, small biases) plus Adam's two moments of each: `mib` MiB of float32."""
    rng = np.random.default_rng(0)
    weights = rng.uniform(0.2, 1.8, 11)
    per_weight = (mib << 20) // 3 // 4 // int(weights.sum() * 100) * 100
    sizes: list[int] = []
    for w in weights:
        sizes += [int(w * per_weight) - 2048, 1024, 1024]  # weight, bias, norm
    params = [torch.randn(n) for n in sizes]
    return params + [torch.randn(n) for n in sizes] + [torch.rand(n) for n in sizes]


def _best(run: Callable[[], Any], repeats: int = 5) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def _time_ways(
    mm: mmap.mmap, tensors: list[torch.Tensor], sources: list[tuple[int, memoryview]], length: int
) -> dict[str, float]:
    dst = torch.frombuffer(mm, dtype=torch.uint8)
    views = [(dst[o : o + t.nbytes], t.reshape(-1).view(torch.uint8)) for (o, _), t in zip(sources, tensors)]
    dst_np = np.frombuffer(mm, dtype=np.uint8)

    def numpy_zlib() -> int:
        for o, src in sources:
            np.copyto(dst_np[o : o + src.nbytes], np.frombuffer(src, dtype=np.uint8))
        return zlib.crc32(dst_np)

    ways: list[tuple[str, Callable[[], Any]]] = [
        ("clone", lambda: [t.clone() for t in tensors]),
        ("torch copy_", lambda: [d.copy_(s) for d, s in views]),
        ("numpy+zlib 1t", numpy_zlib),
        ("python path", lambda: copying.python_copy_checksum(mm, sources, length)),
    ]
    if copying.native_available():
        ways += [
            ("native", lambda: copying.native_copy_checksum(mm, sources, length, copying.THREADS)),
            ("native checksum", lambda: copying.native_checksum(mm, length, copying.THREADS)),
        ]
    ways.append(("python checksum", lambda: copying.python_checksum(mm, length)))
    return {name: _best(run) for name, run in ways}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=192)
    args = parser.parse_args()

    tensors = _model(args.mib)
    sources, offset = [], 0
    for tensor in tensors:
        sources.append((offset, copying.tensor_bytes(tensor)))
        offset += -(-tensor.nbytes // ALIGN) * ALIGN
    length = offset
    total = sum(t.nbytes for t in tensors)

    fd, path = tempfile.mkstemp(prefix="snapcopy-bench-", dir="/dev/shm")
    try:
        os.posix_fallocate(fd, 0, length)
        with mmap.mmap(fd, length) as mm:
            seconds = _time_ways(mm, tensors, sources, length)
    finally:
        os.close(fd)
        os.unlink(path)

    gbps = {name: total / s / 1e9 for name, s in seconds.items()}
    print(f"{len(tensors)} float32 tensors, {total / 2**20:.0f} MiB, {copying.THREADS} threads, best of 5")
    for name, s in seconds.items():
        print(
            f"{name:16s} {s * 1e3:8.1f} ms {gbps[name]:6.2f} GB/s  x{seconds['clone'] / s:5.2f} vs clone  "
            f"x{seconds['python path'] / s:5.2f} vs python path"
        )
    native = gbps.get("native", 0.0)
    print(
        f"SNAPCOPY mib={args.mib} native_gbps={native:.2f} python_gbps={gbps['python path']:.2f} "
        f"clone_gbps={gbps['clone']:.2f} native_vs_clone={native / gbps['clone']:.2f}"
    )


if __name__ == "__main__":
    main()
