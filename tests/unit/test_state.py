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


@pytest.fixture
def host_snapshot(one_rank_world: None, tmp_path, monkeypatch: pytest.MonkeyPatch):
    """This process as its host's snapshot writer, with the agent's slots in tmp_path."""
    from elastic_control_plane.snapshot import layout
    from libworker.world import world

    prefix = str(tmp_path / "elastic-snapshot-1-h")
    layout.create(prefix)
    monkeypatch.setenv("ELASTIC_SNAPSHOT", prefix)
    monkeypatch.setenv("ELASTIC_JOB_KEY", "job-test")
    monkeypatch.setitem(world.slot, "snapshot_writer", True)
    return prefix


def trained_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, elastic.TorchState]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    state = elastic.TorchState(model=model, optimizer=optimizer, epoch=0)
    return model, optimizer, state


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()


def test_the_snapshot_writer_keeps_its_commit_only_in_the_snapshot_and_restores_from_it(host_snapshot: str) -> None:
    from elastic_control_plane.snapshot.layout import buffer_paths
    from elastic_control_plane.snapshot.store import read_newest

    model, optimizer, state = trained_state()
    step(model, optimizer)
    state.epoch = 3
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    assert state._commits == 1 and all(h.saved is None for h in state._handlers.values())
    assert read_newest(buffer_paths(host_snapshot), "job-test", print).commit == 1
    step(model, optimizer)
    state.epoch = 4
    state.restore()
    assert all(torch.equal(committed[k], v) for k, v in model.state_dict().items())
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], exp_avg)
    assert state.epoch == 3


def test_a_writer_that_stops_writing_takes_a_private_copy_before_the_slots_are_reused(host_snapshot: str) -> None:
    from elastic_control_plane.snapshot import layout
    from libworker.world import world

    model, optimizer, state = trained_state()
    step(model, optimizer)
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    world.slot["snapshot_writer"] = False
    state.on_round_entered()
    layout.remove(host_snapshot)
    step(model, optimizer)
    state.restore()
    assert all(torch.equal(committed[k], v) for k, v in model.state_dict().items())


def test_a_fresh_state_loads_a_snapshot_with_its_commit_counter(host_snapshot: str) -> None:
    from libworker.elastic import snapshots

    model, optimizer, state = trained_state()
    step(model, optimizer)
    state.epoch = 7
    for _ in range(5):
        state.commit()
    found = snapshots.restorable()
    fresh_model, fresh_optimizer, fresh = trained_state()
    with torch.no_grad():
        fresh_model.weight.zero_()
    assert fresh.load_snapshot(found)
    assert (fresh._commits, fresh.epoch) == (5, 7)
    assert torch.equal(fresh_model.weight, model.weight)
    assert torch.equal(
        fresh_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )


def test_the_writer_restores_the_state_it_was_synced_to_before_its_first_commit(host_snapshot: str) -> None:
    model, optimizer, state = trained_state()
    state.sync(root_rank=0)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    step(model, optimizer)
    state.restore()
    assert state._commits == 0
    assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items())


def test_an_interrupt_between_commits_marks_the_live_state_ahead_of_the_last_commit(one_rank_world: None) -> None:
    state = elastic.ObjectState(step=0)
    state.on_hosts_updated(150.0, HOST_ADDED)
    with pytest.raises(elastic.HostsUpdatedInterrupt):
        state.commit()
    assert not state._live_ahead, "interrupted right after a commit: the live state is that commit"
    state.step = 1
    state.on_hosts_updated(160.0, HOST_ADDED)
    with pytest.raises(elastic.HostsUpdatedInterrupt):
        state.check_host_updates()
    assert state._live_ahead
    state.commit()
    assert not state._live_ahead


def test_a_worker_restored_from_its_host_goes_through_the_reset_the_others_did(
    host_snapshot: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from libworker.elastic.runner import _restore_from_host
    from libworker.world import world

    model, optimizer, state = trained_state()
    state.commit()
    fresh_model, fresh_optimizer, fresh = trained_state()
    resets: list[int] = []
    fresh.register_reset_callbacks([lambda: resets.append(fresh._commits)])
    monkeypatch.setattr(world, "holds_state", False)
    _restore_from_host(fresh)
    assert world.holds_state and resets == [1]


def test_attributes_named_commits_and_live_ahead_are_the_users(one_rank_world: None) -> None:
    state = elastic.ObjectState(commits=0, live_ahead=False, epoch=0)
    state.commits, state.live_ahead = 5, True
    state.commit()
    state.commits, state.live_ahead = 9, False
    state.restore()
    assert (state.commits, state.live_ahead) == (5, True)
    state.commit()
    assert (state.commits, state._commits) == (5, 2), "the library's counter is its own, and the user's is not counted"


def test_a_torch_state_with_commits_round_trips_it_through_its_host_snapshot(host_snapshot: str) -> None:
    from libworker.elastic import snapshots

    def torch_state() -> elastic.TorchState:
        model = torch.nn.Linear(4, 2)
        return elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), commits=0)

    state = torch_state()
    state.commits = 42
    for _ in range(3):
        state.commit()
    state.commits = 43
    state.restore()
    assert (state.commits, state._commits) == (42, 3)
    fresh = torch_state()
    assert fresh.load_snapshot(snapshots.restorable())
    assert (fresh.commits, fresh._commits) == (42, 3)


@pytest.mark.parametrize("kind", [elastic.ObjectState, elastic.TorchState])
@pytest.mark.parametrize(
    "name", ["commit", "save", "restore", "sync", "reset", "register_reset_callbacks", "check_host_updates", "on_reset"]
)
def test_a_keyword_that_would_shadow_a_method_is_refused_at_once(kind: type[elastic.State], name: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^{kind.__name__}\({name}=\.\.\.\): '{name}' is a method of {kind.__name__}; pick another name",
    ):
        kind(**{name: 1})


@pytest.mark.parametrize("kind", [elastic.ObjectState, elastic.TorchState])
def test_every_public_name_of_the_class_and_every_underscore_name_is_refused(kind: type[elastic.State]) -> None:
    for name in [n for n in dir(kind) if not n.startswith("_")] + ["_commits", "_saved_state", "_x"]:
        with pytest.raises(ValueError, match=rf"^{kind.__name__}\({name}=\.\.\.\): "):
            kind(**{name: 1})


def test_a_module_under_a_method_name_is_refused_too() -> None:
    with pytest.raises(ValueError, match="'save' is a method of TorchState"):
        elastic.TorchState(torch.nn.Linear(1, 1), save=torch.nn.Linear(1, 1))


def test_plain_names_are_the_users() -> None:
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = elastic.ElasticSampler(list(range(4)))
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=1, batch=2, commits=3, live_ahead=4)
    assert (state.model, state.optimizer, state.sampler) == (model, optimizer, sampler)
    assert (state.epoch, state.batch, state.commits, state.live_ahead) == (1, 2, 3, 4)
    assert elastic.ObjectState(commits=0).commits == 0
