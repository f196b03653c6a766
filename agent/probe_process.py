"""The collective probe's process: `python -m elastic_control_plane.agent.probe_process ADDRESS`, started once by an
agent run with `--collective-probe` (agent/collective_probe.py), so that a probe never waits for torch to import.

It serves a TCPStore on ADDRESS at a free port (the store of the next probe its host leads) and prints
`{"store": "ADDRESS:PORT"}`. Then, for each line it reads, a probe `{id, rank, size, store}`, it joins a gloo group
of `size` ranks on that store (under the probe's own key prefix), runs the workload below, and prints
`{"id", "seconds", "collective_s", "store"}` or `{"id", "error", "store"}`; after each probe it serves a fresh store
(the old one, with the probe's keys, is dropped) and says its new address. What a probe leaves behind is bounded
by the agent's fixed malloc threshold (agent/collective_probe.py PROBE_ENV) and by taking torch's excepthook wrapper,
added at each group's start, off at its end; about 5 KiB per probe stays inside torch and gloo (bench/probe_soak.py:
a host probed 1,000 times keeps 5 MiB more).

The workload, ITERATIONS times: the host's own share of an all-reduce (a fixed matrix product and the element-wise
reduction of a fixed-size tensor), then the all-reduce of that tensor with the group. An all-reduce ends on every
rank at the same moment, so its time cannot tell which host held the group up; `seconds` is this host's own share,
outside the collective's waits, and `collective_s` the group's all-reduce time, logged. The process exits when its
stdin closes (the agent stopped).

ELASTIC_PROBE_SLOWDOWN=S (seconds, fault injection for tests and drills) adds S to this host's share of each
iteration, as a host pinned to a busy core would take longer.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic_control_plane.slot_processes.bound_store import serve_store

ITERATIONS = 5
ELEMENTS = 1 << 20  # 4 MiB of float32, all-reduced each iteration
MATRIX = 256
TIMEOUT = timedelta(seconds=10)  # gloo's: a rank that never comes fails the probe for the others within it
SLOWDOWN = "ELASTIC_PROBE_SLOWDOWN"


def serve(address: str) -> dist.TCPStore:
    return serve_store(address, TIMEOUT)


def workload(rank: int, size: int, slowdown: float) -> tuple[float, float]:
    """This host's own seconds and the group's all-reduce seconds, summed over the iterations."""
    tensor, matrix = torch.full((ELEMENTS,), float(rank)), torch.rand(MATRIX, MATRIX)
    dist.all_reduce(tensor)  # the group's connections, outside the measure
    own = collective = 0.0
    for _ in range(ITERATIONS):
        began = time.perf_counter()
        matrix = torch.tanh(matrix @ matrix)
        tensor.mul_(1.0 / size).add_(matrix[0, 0])
        if slowdown:
            time.sleep(slowdown)
        reduced = time.perf_counter()
        dist.all_reduce(tensor)
        own, collective = own + reduced - began, collective + time.perf_counter() - reduced
    return own, collective


def run(probe: dict[str, Any], slowdown: float) -> dict[str, Any]:
    host, port = str(probe["store"]).rsplit(":", 1)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)
    store = dist.PrefixStore(f"probe/{probe['id']}/", client)
    excepthook = sys.excepthook  # init_process_group wraps it anew each time: a chain one link longer per probe
    dist.init_process_group(
        "gloo", store=store, rank=int(probe["rank"]), world_size=int(probe["size"]), timeout=TIMEOUT
    )
    try:
        own, collective = workload(int(probe["rank"]), int(probe["size"]), slowdown)
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
    return {"seconds": round(own, 4), "collective_s": round(collective, 4)}


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    address = sys.argv[1]
    slowdown = float(os.environ.get(SLOWDOWN, "0") or 0)
    torch.set_num_threads(1)
    store = serve(address)
    say({"store": f"{address}:{store.port}"})
    for line in sys.stdin:
        probe = json.loads(line)
        try:
            result = run(probe, slowdown)
        except Exception as exc:  # gloo's and the store's errors: the probe failed, the process serves the next one
            result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
        store = serve(address)
        say({"id": probe["id"], **result, "store": f"{address}:{store.port}"})


if __name__ == "__main__":
    main()
