"""Overhead of libworker's allreduce_ over raw torch.distributed.all_reduce on the same process group.

    python -m bench.collective_overhead [--rounds 15] [--budget 0.15]

One job of 2 ranks on one host, started through the real system (services,
agent, `elasticctl run`); each rank runs `bench/collective_worker.py`, which
times `hvd.allreduce_(t, op=hvd.Sum)`, `hvd.allreduce_(t, op="sum")` and
`torch.distributed.all_reduce(t)` on float32 tensors from 4 B to 64 MB,
interleaved in rotating rounds, medians of the time per call. Every libworker
call is negotiated (libworker.negotiation): `ours` with the cache (one small
allreduce per call once its signature is agreed), `ours_no_cache` with
ELASTIC_NEGOTIATION_CACHE=0 (every call exchanges the whole signature), and
`ours_8_async` the same tensor as 8 async allreduces synchronized together
(one negotiation for the batch), against the same 8 raw async allreduces. The
ratio is raw time / ours (1.0: no overhead). The last line is
`COLLECTIVE_OVERHEAD min_ratio_from_64KB=... negotiation_us=... no_cache_us=...
per_batch_of_8_us=...`: what negotiation adds at 4 B to one call, cached and
uncached, and to a batch of 8.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.common import cluster

RANKS = 2
FROM = 64 << 10


def human(size: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=float, default=0.15, help="Seconds per timed block of calls.")
    args = parser.parse_args()
    with cluster() as c:
        c.start_agent("host-1", slots=RANKS)
        out = c.workdir / "collective.json"
        job = c.submit(
            "--min-np",
            str(RANKS),
            "--max-np",
            str(RANKS),
            "--",
            sys.executable,
            "-m",
            "bench.collective_worker",
            "--out",
            str(out),
            "--rounds",
            str(args.rounds),
            "--budget",
            str(args.budget),
        )
        if c.wait_job_end(job, 600) != 0:
            sys.exit(f"the benchmark job failed; its output:\n{c.output('agent-host-1')[-4000:]}")
        results = {
            name: {int(size): seconds for size, seconds in by_size.items()}
            for name, by_size in json.loads(out.read_text())["results"].items()
        }
    raw, raw_batch = results.pop("raw"), results.pop("raw_8_async")
    baselines = {"ours": raw, "ours_no_cache": raw, "ours_8_async": raw_batch}
    print(
        f"allreduce (sum, float32), {RANKS} ranks on one host, gloo over loopback; median time per call; ratio = "
        "raw / ours"
    )
    print(
        "(ours_8_async: the tensor as 8 async allreduces, then synchronized; its raw is the same 8 raw async "
        "allreduces)"
    )
    print(
        f"{'size':>7} {'raw us':>10} {'raw 8 us':>10} "
        + " ".join(f"{name + ' us':>16} {'ratio':>6}" for name in results)
    )
    ratios_from = []
    for size, raw_seconds in raw.items():
        cells = [
            f"{results[name][size] * 1e6:16.1f} {baselines[name][size] / results[name][size]:6.3f}" for name in results
        ]
        if size >= FROM:
            ratios_from.append(raw_seconds / results["ours"][size])
        print(f"{human(size):>7} {raw_seconds * 1e6:10.1f} {raw_batch[size] * 1e6:10.1f} " + " ".join(cells))
    smallest = min(raw)
    cached = (results["ours"][smallest] - raw[smallest]) * 1e6
    uncached = (results["ours_no_cache"][smallest] - raw[smallest]) * 1e6
    batch = (results["ours_8_async"][smallest] - raw_batch[smallest]) * 1e6
    print(
        f"COLLECTIVE_OVERHEAD min_ratio_from_64KB={min(ratios_from):.3f} negotiation_us={cached:.0f} "
        f"no_cache_us={uncached:.0f} "
        f"per_batch_of_8_us={batch:.0f}"
    )


if __name__ == "__main__":
    main()
