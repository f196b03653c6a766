"""A test job whose last rank fails in every round while the others recover: drives the reset limit."""

import sys

import torch

import libworker as elastic


@elastic.run
def train(state: elastic.ObjectState) -> None:
    while state.step < 1000:
        elastic.allreduce(torch.ones(1))
        state.step += 1
        if state.step % 5 == 0:
            state.commit()
        if state.step >= state.fail_at and elastic.rank() == elastic.size() - 1:
            sys.exit(1)


elastic.init()
train(elastic.ObjectState(step=0, fail_at=20))
