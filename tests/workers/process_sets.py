"""An elastic Horovod script with a process set and a state attribute of its own named `commits`, as users write them:
the even ranks average a value among themselves every step, every rank counts its steps in `state.commits`.
Each step logs the world size, the set's size and sum, the user's counter and the HOROVOD_* variables (`--log-dir`)."""

import argparse
import os
import time

import torch
from train_elastic import EventLog

import libworker as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--step-delay", type=float, default=0.02)
parser.add_argument("--log-dir")
args = parser.parse_args()

rank_before_init = os.environ.get("HOROVOD_RANK")  # horovodrun sets it before the script starts; so does the agent
evens = hvd.ProcessSet([0, 2, 4])
hvd.init(process_sets=[evens])
log = EventLog(args.log_dir)
state = hvd.elastic.ObjectState(step=0, commits=0)


@hvd.elastic.run
def train(state: hvd.elastic.ObjectState) -> None:
    while state.step < args.steps:
        world = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="world")
        in_set = (
            hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=evens, name="evens")
            if evens.included()
            else None
        )
        log.write(
            "step",
            step=state.step,
            commits=state.commits,
            world=world.item(),
            set_size=evens.size(),
            set_sum=None if in_set is None else in_set.item(),
            included=evens.included(),
            set_rank=evens.rank(),
            rank_before_init=rank_before_init,
            horovod_rank=os.environ["HOROVOD_RANK"],
            horovod_size=os.environ["HOROVOD_SIZE"],
        )
        state.step += 1
        state.commits += 1
        state.commit()
        time.sleep(args.step_delay)


train(state)
