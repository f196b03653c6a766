"""One rank of a 2-rank gloo round formed the way libworker.world forms rounds (a TCPStore, a prefix per round),
for the test of a round that failed to form. Usage: form_round.py PORT RANK ROUND [FAILED_ROUND]

With FAILED_ROUND, the process first tries to form that round alone (its peer never comes: the formation times
out, as when a peer is killed while the group connects) and releases it as a worker leaving a round does. Then it
forms ROUND with its peer and prints the sum of an allreduce of (rank + 1)."""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from libworker.world import release_process_group

port, rank, round_number = (int(arg) for arg in sys.argv[1:4])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30), wait_for_workers=False)
if len(sys.argv) > 4:
    try:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"round/{sys.argv[4]}/", store),
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=1),
        )
        sys.exit("the round formed without its peer")
    except (RuntimeError, dist.DistError):
        release_process_group()
dist.init_process_group(
    "gloo",
    store=dist.PrefixStore(f"round/{round_number}/", store),
    rank=rank,
    world_size=2,
    timeout=timedelta(seconds=20),
)
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"allreduce gave {total.item():g}", flush=True)
dist.destroy_process_group()
