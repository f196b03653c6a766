"""One rank of a 3-rank gloo round in which ranks 0 and 1 leave a collective pending that rank 2, alive, never
took part in (as survivors leave a gradient bucket launched ahead of the one that failed), for the test of
leaving a round. Usage: leave_with_pending_work.py PORT RANK

Ranks 0 and 1 launch an allreduce through libworker's abortable core, release the round as a worker that
joins the next one does, and print how long the release took; then they form round 2 between them, print the
sum of an allreduce of (rank + 1), and let rank 2 go. Its departure ends their pending work; they go on
launching small allreduces (which agree on whether either still holds an old group, so both stop together)
until the old round's group is dropped, and print how many rounds are still held.
Rank 2 only forms round 1 and waits to be let go."""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from libworker.collectives import launch, run_collective
from libworker.world import release_process_group, world

TIMEOUT = timedelta(seconds=10)
port, rank = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=60), wait_for_workers=False)
dist.init_process_group("gloo", store=dist.PrefixStore("round/1/", store), rank=rank, world_size=3, timeout=TIMEOUT)
if rank == 2:
    store.wait(["let_rank_2_go"], timedelta(seconds=60))
    sys.exit(0)

world.slot, world.round = {"rank": rank, "size": 3}, 1
launch(lambda: dist.all_reduce(torch.ones(1000), async_op=True))
started = time.monotonic()
release_process_group()
print(f"released after {time.monotonic() - started:.2f}s, holding {len(world.retired.rounds)}", flush=True)

world.slot, world.round = {"rank": rank, "size": 2}, 2
dist.init_process_group("gloo", store=dist.PrefixStore("round/2/", store), rank=rank, world_size=2, timeout=TIMEOUT)
total = torch.tensor([float(rank + 1)])
run_collective(lambda: dist.all_reduce(total, async_op=True))
print(f"allreduce gave {total.item():g}", flush=True)
store.set(f"rank_{rank}_formed_round_2", "1")
store.wait(["rank_0_formed_round_2", "rank_1_formed_round_2"], timedelta(seconds=60))
if rank == 0:
    store.set("let_rank_2_go", "1")
deadline = time.monotonic() + 30.0
while True:
    holding = torch.tensor([float(len(world.retired.rounds)), float(time.monotonic() > deadline)])
    run_collective(lambda: dist.all_reduce(holding, op=dist.ReduceOp.MAX, async_op=True))
    if holding[0] == 0 or holding[1] > 0:
        break
    time.sleep(0.01)
print(f"still holding {len(world.retired.rounds)}", flush=True)
run_collective(lambda: dist.barrier(async_op=True))
release_process_group()
