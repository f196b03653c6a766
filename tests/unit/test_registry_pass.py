"""Pass (services/registry/peers.py): a driver pass as one sequence of steps; each step's reads go out at once, the
pass resumes with their answers in order, ends on a failed read or when no longer wanted, and ends once."""

from __future__ import annotations

from typing import Any

import pytest

from elastic_control_plane.bus.client import Unreachable
from elastic_control_plane.services.registry.peers import Pass, Read, Steps


class FakePeer:
    """Holds each read's callbacks until the test answers it."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, Any, Any]] = []

    def read(self, msg_type: str, body: dict[str, Any], answered: Any, failed: Any) -> None:
        self.asked.append((msg_type, answered, failed))


def run(steps: Steps, wanted: bool = True) -> dict[str, Any]:
    seen: dict[str, Any] = {"blind": [], "done": 0}

    def done() -> None:
        seen["done"] += 1

    Pass(steps, wanted=lambda: wanted, blind=seen["blind"].append, done=done)
    return seen


def test_a_step_resumes_with_every_answer_in_order_once_all_arrived() -> None:
    discovery, rendezvous, got = FakePeer(), FakePeer(), []

    def steps() -> Steps:
        hosts, rounds = yield [Read(discovery, "hosts", {}), Read(rendezvous, "status", {})]
        got.append((hosts, rounds))
        (full,) = yield [Read(discovery, "hosts", {"full": True})]
        got.append(full)

    seen = run(steps())
    rendezvous.asked[0][1]({"round": 2})
    assert got == [] and seen["done"] == 0, "the step waits for both answers"
    discovery.asked[0][1]({"available": []})
    assert got == [({"available": []}, {"round": 2})]
    discovery.asked[1][1]({"all": []})
    assert got[1] == {"all": []} and seen["done"] == 1


def test_a_failed_read_ends_the_pass_and_a_late_answer_is_dropped() -> None:
    discovery, rendezvous, got = FakePeer(), FakePeer(), []

    def steps() -> Steps:
        got.append((yield [Read(discovery, "hosts", {}), Read(rendezvous, "status", {})]))

    seen = run(steps())
    discovery.asked[0][2](Unreachable("tcp://discovery", 1.0))
    rendezvous.asked[0][1]({"round": 1})
    assert got == [] and len(seen["blind"]) == 1 and seen["done"] == 1


def test_a_pass_no_longer_wanted_ends_without_its_next_step() -> None:
    discovery, got = FakePeer(), []

    def steps() -> Steps:
        got.append((yield [Read(discovery, "hosts", {})]))

    seen = run(steps(), wanted=False)
    discovery.asked[0][1]({})
    assert got == [] and seen == {"blind": [], "done": 1}


def test_a_step_that_raises_still_ends_the_pass() -> None:
    discovery = FakePeer()

    def steps() -> Steps:
        yield [Read(discovery, "hosts", {})]
        raise RuntimeError("a bug in a step")

    seen = run(steps())
    with pytest.raises(RuntimeError):
        discovery.asked[0][1]({})
    assert seen["done"] == 1
