"""Our Python Stores are whole Stores: every method of torch's Store interface, listed from torch itself, is ours
(a method a Python subclass lacks fails in C++ with "Not implemented" when torch calls it: a process set's group
failed so on the round's AbortableStore); each of AbortableStore's waits ends at the round's abort; and a process
set whose group fails to build is not registered."""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import NoReturn

import pytest
import torch.distributed as dist

import libworker
from libworker import process_sets
from libworker.forming_store import AbortableStore, RoundFormationAborted
from testing.harness import free_ports


def store_interface() -> list[str]:
    """The public methods of torch's Store (not the `timeout` property: set_timeout keeps it)."""
    return sorted(
        name
        for name, member in vars(dist.Store).items()
        if not name.startswith("_") and callable(member) and not isinstance(member, property)
    )


def our_store_classes() -> list[type]:
    for module in pkgutil.walk_packages(libworker.__path__, "libworker."):
        importlib.import_module(module.name)
    found, pending = [], list(dist.Store.__subclasses__())
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        if cls.__module__.startswith(("libworker", "elastic_control_plane")):
            found.append(cls)
    return found


def test_the_interface_is_read_from_torch() -> None:
    assert {"get", "set", "wait", "check", "append", "multi_get", "queue_pop", "clone"} <= set(store_interface())


@pytest.mark.parametrize("cls", our_store_classes(), ids=lambda cls: cls.__qualname__)
def test_every_store_of_ours_implements_the_whole_interface(cls: type) -> None:
    missing = [
        name
        for name in store_interface()
        if not any(name in vars(c) for c in cls.__mro__[: cls.__mro__.index(dist.Store)])
    ]
    assert not missing, f"{cls.__qualname__} lacks {missing}: torch would fail in C++ with 'Not implemented'"


def test_abortable_store_is_among_them() -> None:
    assert AbortableStore in our_store_classes()


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    (port,) = free_ports(1)
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=5))
    yield store
    del store


def test_every_method_reaches_the_store_it_wraps(server: dist.TCPStore) -> None:
    store = AbortableStore(dist.PrefixStore("round-3", server), lambda: False)
    store.set("a", b"1")
    store.append("a", b"2")
    store.multi_set(["b", "c"], [b"3", b"4"])
    assert store.multi_get(["a", "b", "c"]) == [b"12", b"3", b"4"] and store.get("a") == b"12"
    assert store.add("n", 2) == 2 and store.compare_set("b", "3", "5") == b"5" and store.check(["a", "c"])
    assert store.delete_key("c") and not store.check(["c"]) and server.check(["round-3/a"])
    store.queue_push("q", b"x")
    assert store.queue_len("q") == 1 and store.queue_pop("q") == b"x" and store.queue_len("q") == 0
    assert store.has_extended_api() == server.has_extended_api()
    assert store.num_keys() == server.num_keys()
    store.set_timeout(timedelta(seconds=7))
    assert store.timeout == timedelta(seconds=7) == store.inner.timeout
    clone = store.clone()
    assert isinstance(clone, AbortableStore) and clone.get("a") == b"12"
    store.barrier("all", 1)


@pytest.mark.parametrize(
    "blocking",
    [
        lambda s: s.get("never"),
        lambda s: s.wait(["never"]),
        lambda s: s.multi_get(["a", "never"]),
        lambda s: s.barrier("of-two", 2),
        lambda s: s.queue_pop("empty"),
    ],
    ids=["get", "wait", "multi_get", "barrier", "queue_pop"],
)
def test_each_wait_ends_at_the_abort(server: dist.TCPStore, blocking: Callable[[AbortableStore], object]) -> None:
    aborted = threading.Event()
    store = AbortableStore(server, aborted.is_set)
    store.set("a", b"1")
    threading.Timer(0.2, aborted.set).start()
    with pytest.raises(RoundFormationAborted):
        blocking(store)


def test_a_wait_for_a_key_that_comes_returns_it(server: dist.TCPStore) -> None:
    store = AbortableStore(server, lambda: False)
    threading.Timer(0.1, lambda: server.set("late", b"here")).start()
    assert store.get("late") == b"here"


def test_a_process_set_whose_group_fails_is_not_registered(
    one_rank_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The set is not left registered, so the next add of the same ranks is no duplicate and works."""
    monkeypatch.setattr(process_sets, "_registry", process_sets._Registry({}, {}))
    real_new_group = dist.new_group

    def failing_once(ranks: list[int]) -> NoReturn:
        monkeypatch.setattr(dist, "new_group", real_new_group)
        raise RuntimeError("Not implemented.")

    monkeypatch.setattr(dist, "new_group", failing_once)
    with pytest.raises(RuntimeError, match="Not implemented"):
        process_sets.add_process_set([0])
    assert process_sets._registry.sets == {} and process_sets._registry.groups == {}
    added = process_sets.add_process_set([0])
    assert added.process_set_id == 1 and added.size() == 1
    assert process_sets.remove_process_set(added)
