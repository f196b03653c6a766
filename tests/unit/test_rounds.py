"""Rounds: parked joins, released together once a round is complete; removed slots; pruning."""

from __future__ import annotations

import time

from elastic_control_plane.job.assignments import get_host_assignments
from elastic_control_plane.services.rendezvous.rounds import Join, Rounds


def new_round(rounds: Rounds, hosts: list[tuple[str, int]], timestamp: float = 1.0):
    return rounds.add_round(get_host_assignments(hosts, 1), timestamp)


def join(host: str, local_rank: int, after_round: int = 0, pid: int | None = None, ticket: str | None = None) -> Join:
    pid = pid if pid is not None else 100 + local_rank
    return Join((host, local_rank), after_round, pid, ticket or f"{host}:{local_rank}:{pid}")


def by_ticket(answers) -> dict:
    tickets = [t for t, _ in answers]
    assert len(tickets) == len(set(tickets)), "a ticket was answered twice"
    return dict(answers)


# -- release when complete -----------------------------------------------------------------------


def test_joins_are_parked_until_every_slot_of_the_round_has_joined():
    rounds = Rounds()
    new_round(rounds, [("a", 2), ("b", 1)])
    rounds.park(join("a", 0))
    assert rounds.settle() == []
    rounds.park(join("b", 0))
    assert rounds.settle() == []
    assert set(rounds.parked) == {("a", 0), ("b", 0)}
    assert rounds.current.released is False


def test_complete_round_releases_every_join_together_with_its_slot_info():
    rounds = Rounds()
    new_round(rounds, [("a", 2), ("b", 1)], timestamp=42.5)
    for j in (join("b", 0, pid=7), join("a", 1, pid=8), join("a", 0, pid=9)):
        rounds.park(j)
    answers = by_ticket(rounds.settle())
    assert answers == {
        "a:0:9": {
            "round": 1,
            "prefix": "round/1/",
            "hosts_timestamp": 42.5,
            "snapshot_writer": True,
            "hostname": "a",
            "rank": 0,
            "local_rank": 0,
            "cross_rank": 0,
            "size": 3,
            "local_size": 2,
            "cross_size": 2,
        },
        "a:1:8": {
            "round": 1,
            "prefix": "round/1/",
            "hosts_timestamp": 42.5,
            "snapshot_writer": False,
            "hostname": "a",
            "rank": 1,
            "local_rank": 1,
            "cross_rank": 0,
            "size": 3,
            "local_size": 2,
            "cross_size": 1,
        },
        "b:0:7": {
            "round": 1,
            "prefix": "round/1/",
            "hosts_timestamp": 42.5,
            "snapshot_writer": True,
            "hostname": "b",
            "rank": 2,
            "local_rank": 0,
            "cross_rank": 1,
            "size": 3,
            "local_size": 1,
            "cross_size": 2,
        },
    }
    assert rounds.parked == {}
    assert rounds.current.released is True
    assert rounds.current.pids == {("a", 0): 9, ("a", 1): 8, ("b", 0): 7}


def test_the_lowest_rank_of_each_host_writes_its_snapshot_even_with_a_hole():
    rounds = Rounds()
    new_round(rounds, [("a", [1, 2]), ("b", [0])])
    for j in (join("a", 1), join("a", 2), join("b", 0)):
        rounds.park(j)
    writers = {(a["hostname"], a["local_rank"]) for _, a in rounds.settle() if a["snapshot_writer"]}
    assert writers == {("a", 1), ("b", 0)}


def test_settle_after_release_answers_nothing_more():
    rounds = Rounds()
    new_round(rounds, [("a", 1)])
    rounds.park(join("a", 0))
    assert len(rounds.settle()) == 1
    assert rounds.settle() == []


def test_settle_without_a_round_answers_nothing():
    rounds = Rounds()
    rounds.park(join("a", 0))
    assert rounds.settle() == []
    assert ("a", 0) in rounds.parked


def test_joins_parked_before_the_round_exists_are_released_by_it():
    rounds = Rounds()
    rounds.park(join("a", 0))
    rounds.park(join("a", 1))
    assert rounds.settle() == []
    new_round(rounds, [("a", 2)])
    assert len(rounds.settle()) == 2


def test_round_hosts_are_in_rank_order_and_prefix_names_the_round():
    rounds = Rounds()
    new_round(rounds, [("b", 1), ("a", 2), ("c", 1)])
    assert rounds.current.hosts == ["b", "a", "c"]
    assert rounds.current.prefix == "round/1/"
    assert new_round(rounds, [("a", 1)]).prefix == "round/2/"


# -- removed slots -------------------------------------------------------------------------------


def test_join_for_a_slot_not_in_the_newer_round_is_told_removed():
    rounds = Rounds()
    new_round(rounds, [("a", 2), ("b", 1)])
    for j in (join("a", 0), join("a", 1), join("b", 0)):
        rounds.park(j)
    rounds.settle()
    new_round(rounds, [("a", 1)])  # a:1 and b:0 are gone
    rounds.park(join("b", 0, after_round=1))
    answers = by_ticket(rounds.settle())
    assert answers == {"b:0:100": {"removed": True, "round": 2}}
    assert ("b", 0) not in rounds.parked


def test_removed_answer_does_not_wait_for_the_round_to_complete():
    rounds = Rounds()
    new_round(rounds, [("a", 2)])
    new_round(rounds, [("a", 2)])
    rounds.park(join("a", 1, after_round=1))
    new_round(rounds, [("a", 1)])
    answers = rounds.settle()
    assert answers == [("a:1:101", {"removed": True, "round": 3})]
    assert rounds.current.released is False


def test_a_process_never_in_a_round_waits_for_a_round_with_its_slot_instead_of_being_removed():
    rounds = Rounds()
    new_round(rounds, [("a", [0])])  # slot a:1 is down: its replacement starts
    rounds.park(join("a", 1))
    assert rounds.settle() == []
    assert ("a", 1) in rounds.parked
    rounds.park(join("a", 0))
    assert [t for t, _ in rounds.settle()] == ["a:0:100"]
    new_round(rounds, [("a", [0, 1])])
    rounds.park(join("a", 0, after_round=1))
    answers = by_ticket(rounds.settle())
    assert answers["a:1:101"]["local_rank"] == 1 and answers["a:1:101"]["size"] == 2


def test_removed_slots_and_released_slots_are_answered_in_one_settle():
    rounds = Rounds()
    new_round(rounds, [("a", 1), ("b", 1)])
    new_round(rounds, [("a", 1)])
    rounds.park(join("a", 0, after_round=1))
    rounds.park(join("b", 0, after_round=1))
    answers = by_ticket(rounds.settle())
    assert answers["b:0:100"] == {"removed": True, "round": 2}
    assert answers["a:0:100"]["rank"] == 0 and answers["a:0:100"]["size"] == 1 and answers["a:0:100"]["round"] == 2


def test_join_for_a_slot_not_in_the_round_but_already_up_to_date_is_not_removed():
    rounds = Rounds()
    new_round(rounds, [("a", 1)])
    rounds.park(join("b", 0, after_round=1))
    assert rounds.settle() == []
    assert ("b", 0) in rounds.parked


# -- released rounds and after_round -------------------------------------------------------------


def test_released_round_admits_no_late_joiner_who_waits_for_the_next_round():
    rounds = Rounds()
    new_round(rounds, [("a", 2)])
    rounds.park(join("a", 0, pid=1))
    rounds.park(join("a", 1, pid=2))
    assert len(rounds.settle()) == 2
    # a:1 died and was respawned: its new process asks for any round (after_round 0)
    rounds.park(join("a", 1, after_round=0, pid=3))
    assert rounds.settle() == []
    assert ("a", 1) in rounds.parked
    # the next round takes it, once a:0 has re-joined too
    new_round(rounds, [("a", 2)])
    assert rounds.settle() == []
    rounds.park(join("a", 0, after_round=1, pid=1))
    answers = by_ticket(rounds.settle())
    assert {body["round"] for body in answers.values()} == {2}
    assert answers["a:1:3"]["rank"] == 1
    assert rounds.current.pids == {("a", 0): 1, ("a", 1): 3}


def test_late_joiner_for_a_removed_slot_of_a_released_round_waits_too():
    rounds = Rounds()
    new_round(rounds, [("a", 1)])
    rounds.park(join("a", 0))
    rounds.settle()
    rounds.park(join("b", 0, after_round=0))
    assert rounds.settle() == []
    assert ("b", 0) in rounds.parked


def test_join_with_after_round_at_latest_stays_parked_and_blocks_release():
    rounds = Rounds()
    new_round(rounds, [("a", 2)])
    rounds.park(join("a", 0, after_round=0))
    rounds.park(join("a", 1, after_round=1))  # already in round 1: wants round 2
    assert rounds.settle() == []
    assert set(rounds.parked) == {("a", 0), ("a", 1)}
    assert rounds.current.released is False


def test_join_with_after_round_beyond_latest_stays_parked():
    rounds = Rounds()
    new_round(rounds, [("a", 1)])
    rounds.park(join("a", 0, after_round=5))
    assert rounds.settle() == []
    assert ("a", 0) in rounds.parked


def test_survivors_of_a_round_are_released_by_the_next_complete_round():
    rounds = Rounds()
    new_round(rounds, [("a", 1), ("b", 1)])
    rounds.park(join("a", 0))
    rounds.park(join("b", 0))
    rounds.settle()
    new_round(rounds, [("a", 1), ("b", 1), ("c", 1)])
    rounds.park(join("a", 0, after_round=1))
    rounds.park(join("b", 0, after_round=1))
    assert rounds.settle() == []
    rounds.park(join("c", 0, after_round=0))
    answers = by_ticket(rounds.settle())
    assert sorted((body["hostname"], body["rank"], body["size"]) for body in answers.values()) == [
        ("a", 0, 3),
        ("b", 1, 3),
        ("c", 2, 3),
    ]


# -- forget / park -------------------------------------------------------------------------------


def test_forget_drops_a_parked_join_of_the_same_pid():
    rounds = Rounds()
    j = join("a", 0, pid=11)
    rounds.park(j)
    assert rounds.forget(("a", 0), 11) is j
    assert rounds.parked == {}


def test_forget_keeps_a_parked_join_of_another_pid():
    rounds = Rounds()
    rounds.park(join("a", 0, pid=12))
    assert rounds.forget(("a", 0), 11) is None
    assert rounds.parked[("a", 0)].pid == 12


def test_forget_of_an_unparked_slot_is_none():
    assert Rounds().forget(("a", 0), 1) is None


def test_forgotten_join_no_longer_counts_for_release():
    rounds = Rounds()
    new_round(rounds, [("a", 2)])
    rounds.park(join("a", 0, pid=1))
    rounds.forget(("a", 0), 1)
    rounds.park(join("a", 1, pid=2))
    assert rounds.settle() == []


def test_a_join_for_a_parked_slot_replaces_it():
    rounds = Rounds()
    rounds.park(join("a", 0, pid=1, ticket="old"))
    rounds.park(join("a", 0, pid=2, ticket="new"))
    assert rounds.parked[("a", 0)].ticket == "new"
    assert rounds.parked[("a", 0)].pid == 2


def test_park_of_the_same_ticket_again_replaces_nothing():
    rounds = Rounds()
    rounds.park(join("a", 0, ticket="t"))
    assert rounds.park(join("a", 0, ticket="t")) is None


def test_replaced_join_is_not_answered_only_the_new_one_is():
    rounds = Rounds()
    new_round(rounds, [("a", 1)])
    rounds.park(join("a", 0, pid=1, ticket="old"))
    rounds.park(join("a", 0, pid=2, ticket="new"))
    answers = rounds.settle()
    assert [t for t, _ in answers] == ["new"]
    assert rounds.current.pids == {("a", 0): 2}


# -- pruning -------------------------------------------------------------------------------------


def test_round_numbers_increase_from_one():
    rounds = Rounds()
    assert rounds.current is None
    assert [new_round(rounds, [("a", 1)]).number for _ in range(3)] == [1, 2, 3]
    assert rounds.latest == 3
    assert rounds.current.number == 3


def test_old_rounds_are_pruned_keeping_latest_and_previous():
    rounds = Rounds()
    for _ in range(5):
        new_round(rounds, [("a", 1)])
    assert sorted(rounds.rounds) == [4, 5]


def test_empty_round_releases_at_once_and_removes_every_parked_join():
    rounds = Rounds()
    new_round(rounds, [("a", 1)])
    rounds.park(join("a", 0))
    rounds.settle()
    rounds.add_round([], 2.0)
    rounds.park(join("a", 0, after_round=1))
    assert rounds.settle() == [("a:0:100", {"removed": True, "round": 2})]


# -- a restarted rendezvous, given back the job's round ------------------------------------------
def test_a_restored_released_round_admits_no_joiner_and_numbering_goes_on() -> None:
    rounds = Rounds()
    slots = get_host_assignments([("a", 1), ("b", 1)], 1)
    rounds.restore(7, slots, 3.0, released=True, pids={("a", 0): 100, ("b", 0): 101})
    rounds.park(join("a", 0, after_round=6, pid=100))
    assert rounds.settle() == [], "a released round admits no late joiner"
    new = new_round(rounds, [("a", 1), ("b", 1)])
    assert new.number == 8
    rounds.park(join("b", 0, after_round=7, pid=101))
    assert len(rounds.settle()) == 2


def test_a_restored_unreleased_round_is_completed_by_the_joins_sent_again() -> None:
    rounds = Rounds()
    rounds.park(join("a", 0, after_round=4, pid=100))
    assert rounds.settle() == [], "nothing to answer before the round is restored"
    rounds.restore(5, get_host_assignments([("a", 1), ("b", 1)], 1), 3.0, released=False, pids={})
    rounds.park(join("b", 0, after_round=0, pid=101))
    answers = by_ticket(rounds.settle())
    assert {a["round"] for a in answers.values()} == {5} and len(answers) == 2


def test_32768_joins_arriving_one_at_a_time_settle_in_under_a_second() -> None:
    """4,096 hosts x 8 slots: each join is settled as it arrives (as the service does), in O(1), not by a rescan."""
    hosts = [(f"host-{h}", 8) for h in range(4096)]
    rounds = Rounds()
    rounds.add_round(get_host_assignments(hosts, min_np=1), 1.0)
    started = time.perf_counter()
    answered = []
    for host, slots in hosts:
        for local_rank in range(slots):
            rounds.park(Join((host, local_rank), 0, pid=local_rank, ticket=(host, local_rank)))
            answered += rounds.settle()
    elapsed = time.perf_counter() - started
    assert len(answered) == 32_768 and {a["rank"] for _, a in answered} == set(range(32_768))
    assert elapsed < 1.0, f"32,768 joins took {elapsed:.2f}s to settle"


def test_a_round_replaced_while_forming_removes_the_slots_it_drops_even_for_late_first_joins() -> None:
    rounds = Rounds()
    new_round(rounds, [("a", 1), ("b", 1), ("c", 1)])
    rounds.park(join("a", 0))
    rounds.park(join("c", 0))
    assert rounds.settle() == []
    new_round(rounds, [("a", 1), ("b", 1)])  # c drained while round 1 formed
    removed = by_ticket(rounds.settle())
    assert removed == {"c:0:100": {"removed": True, "round": 2}}
    rounds.park(join("c", 0, pid=7))  # a sibling that had not joined yet
    assert by_ticket(rounds.settle()) == {"c:0:7": {"removed": True, "round": 2}}
    rounds.park(join("b", 0))
    released = by_ticket(rounds.settle())
    assert sorted(released) == ["a:0:100", "b:0:100"] and released["b:0:100"]["size"] == 2


def test_a_first_join_waits_for_a_round_with_its_slot_when_no_replaced_round_had_it() -> None:
    rounds = Rounds()
    new_round(rounds, [("a", 1)])
    rounds.park(join("a", 0))
    rounds.settle()
    new_round(rounds, [("a", 1)])
    rounds.park(join("w", 0))  # a warming host's worker
    assert rounds.settle() == [] and ("w", 0) in rounds.parked


# -- the rejoin log: what the registry reads with a cursor ---------------------------------------
def rejoined(rounds: Rounds, round_number: int, cursor: int) -> tuple[list[tuple[str, int, int, int]], int]:
    return rounds.rejoins_since(round_number, cursor)


def released_round(rounds: Rounds, hosts: list[tuple[str, int]]) -> None:
    """A new round on `hosts`, joined by every slot (pid 100 + local rank) and released."""
    number = new_round(rounds, hosts).number
    for host, slots in hosts:
        for local_rank in range(slots):
            rounds.park(join(host, local_rank, after_round=number - 1))
    assert len(rounds.settle()) == sum(slots for _, slots in hosts)


def test_rejoins_are_read_from_a_cursor_in_the_order_they_parked() -> None:
    rounds = Rounds()
    released_round(rounds, [("a", 2), ("b", 1)])
    assert rejoined(rounds, 1, 0) == ([], 0)
    rounds.park(join("b", 0, after_round=1))
    rounds.park(join("a", 1, after_round=1))
    assert rejoined(rounds, 1, 0) == ([("b", 0, 100, 1), ("a", 1, 101, 1)], 2)
    rounds.park(join("a", 0, after_round=1))
    assert rejoined(rounds, 1, 2) == ([("a", 0, 100, 1)], 3), "only what parked since the cursor"
    assert rejoined(rounds, 1, 3) == ([], 3)


def test_a_first_join_or_one_for_an_older_round_is_no_rejoin() -> None:
    rounds = Rounds()
    released_round(rounds, [("a", 1)])
    released_round(rounds, [("a", 1), ("b", 1)])
    rounds.park(join("c", 0, after_round=0))  # a warming host's worker
    rounds.park(join("b", 0, after_round=1, pid=7))  # a leftover of round 1
    assert rejoined(rounds, 2, 0) == ([], 0)


def test_a_slot_parking_again_with_the_same_worker_is_logged_once() -> None:
    rounds = Rounds()
    released_round(rounds, [("a", 1)])
    for _ in range(1000):
        rounds.park(join("a", 0, after_round=1, ticket="retry"))
    rounds.forget(("a", 0), 100)
    rounds.park(join("a", 0, after_round=1))
    rounds.park(join("a", 0, after_round=1, pid=200))  # another worker of the slot
    assert rejoined(rounds, 1, 0) == ([("a", 0, 100, 1), ("a", 0, 200, 1)], 2)


def test_a_new_round_starts_the_log_again_and_a_cursor_of_another_round_reads_it_all() -> None:
    rounds = Rounds()
    released_round(rounds, [("a", 1), ("b", 1)])
    rounds.park(join("a", 0, after_round=1))
    rounds.park(join("b", 0, after_round=1))
    assert rejoined(rounds, 1, 0)[1] == 2
    released_round(rounds, [("a", 1), ("b", 1)])
    assert rejoined(rounds, 1, 2) == ([], 0), "round 2's log is empty; a cursor of round 1 reads it from the start"
    rounds.park(join("a", 0, after_round=2))
    assert rejoined(rounds, 1, 2) == ([("a", 0, 100, 2)], 1)
    assert rejoined(rounds, 2, 5) == ([("a", 0, 100, 2)], 1), "a cursor past the log's end reads it all"


def test_a_restored_round_logs_the_rejoins_parked_before_it() -> None:
    """A restarted rendezvous hears the survivors' joins before the registry gives it the job's round back."""
    rounds = Rounds()
    rounds.park(join("a", 0, after_round=3, pid=100))
    rounds.park(join("b", 0, after_round=0, pid=101))
    rounds.restore(3, get_host_assignments([("a", 1), ("b", 1)], 1), 3.0, released=True, pids={})
    assert rejoined(rounds, 0, 0) == ([("a", 0, 100, 3)], 1)
