"""State semantics on a one-rank world (gloo over an in-memory store): commit, restore, host updates, reset."""

from __future__ import annotations


import pytest
import torch

import libworker as elastic
from libworker.world import HOST_ADDED, HOST_REMOVED


def test_commit_then_restore_returns_to_the_commit(one_rank_world: None) -> None:
    state = elastic.ObjectState(step=0, history=[])
    state.step, state.history = 5, [1, 2]
    state.commit()
    state.step, state.history = 9, [1, 2, 3]
    state.restore()
    assert (state.step, state.history) == (5, [1, 2])


def test_torch_state_restores_model_and_optimizer(one_rank_world: None) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = elastic.TorchState(model=model, optimizer=optimizer, epoch=0)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert optimizer.state_dict()["state"] == {}


def test_an_update_newer_than_the_round_interrupts_and_says_whether_to_sync(one_rank_world: None) -> None:
    state = elastic.ObjectState(step=0)
    state.on_hosts_updated(150.0, HOST_REMOVED)
    with pytest.raises(elastic.HostsUpdatedInterrupt) as removed:
        state.commit()
    assert removed.value.skip_sync
    state.on_hosts_updated(160.0, HOST_ADDED)
    with pytest.raises(elastic.HostsUpdatedInterrupt) as added:
        state.check_host_updates()
    assert not added.value.skip_sync
    state.check_host_updates()


def test_updates_the_round_already_reflects_are_ignored(one_rank_world: None) -> None:
    state = elastic.ObjectState(step=0)
    state.on_hosts_updated(90.0, HOST_ADDED)
    state.on_hosts_updated(100.0, HOST_REMOVED)
    state.commit()


def test_on_reset_keeps_updates_that_arrived_while_rejoining(one_rank_world: None) -> None:
    calls: list[str] = []
    state = elastic.ObjectState(step=0)
    state.register_reset_callbacks([lambda: calls.append("reset")])
    state.on_hosts_updated(99.0, HOST_REMOVED)
    state.on_hosts_updated(120.0, HOST_ADDED)
    state.on_reset()
    assert calls == ["reset"]
    with pytest.raises(elastic.HostsUpdatedInterrupt):
        state.check_host_updates()
