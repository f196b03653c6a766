"""get_host_assignments against Horovod's semantics, with every expected value worked out by hand.

Each row of an expected table is (hostname, rank, local_rank, cross_rank, size, local_size, cross_size).
"""

from __future__ import annotations

import pytest

from elastic_control_plane.job.assignments import NotEnoughSlots, SlotInfo, get_host_assignments
from elastic_control_plane.slot_processes.rounds import round_environment

UNEVEN = [("a", 2), ("b", 1), ("c", 3)]
# a: ranks 0,1   b: rank 2   c: ranks 3,4,5
# local_rank 0 lives on a,b,c (cross_size 3); local_rank 1 on a,c (2); local_rank 2 on c only (1).
UNEVEN_ALL = [
    ("a", 0, 0, 0, 6, 2, 3),
    ("a", 1, 1, 0, 6, 2, 2),
    ("b", 2, 0, 1, 6, 1, 3),
    ("c", 3, 0, 2, 6, 3, 3),
    ("c", 4, 1, 1, 6, 3, 2),
    ("c", 5, 2, 0, 6, 3, 1),
]


def rows(assignments: list[SlotInfo]) -> list[tuple[str, int, int, int, int, int, int]]:
    return [(s.hostname, s.rank, s.local_rank, s.cross_rank, s.size, s.local_size, s.cross_size) for s in assignments]


CASES = {
    "uneven_no_max": (UNEVEN, 1, None, UNEVEN_ALL),
    # max_np 6 == total slots: same as no max.
    "uneven_max_equals_total": (UNEVEN, 6, 6, UNEVEN_ALL),
    # max_np 4 cuts c after its first slot: c has local_size 1, local_rank 1 is on a only.
    "max_np_cuts_inside_host": (
        UNEVEN,
        1,
        4,
        [
            ("a", 0, 0, 0, 4, 2, 3),
            ("a", 1, 1, 0, 4, 2, 1),
            ("b", 2, 0, 1, 4, 1, 3),
            ("c", 3, 0, 2, 4, 1, 3),
        ],
    ),
    # max_np 5 cuts c after two slots.
    "max_np_cuts_inside_last_host_later": (
        UNEVEN,
        1,
        5,
        [
            ("a", 0, 0, 0, 5, 2, 3),
            ("a", 1, 1, 0, 5, 2, 2),
            ("b", 2, 0, 1, 5, 1, 3),
            ("c", 3, 0, 2, 5, 2, 3),
            ("c", 4, 1, 1, 5, 2, 2),
        ],
    ),
    # max_np 3 ends exactly at the a|b -> c boundary: c gets nothing and counts for no cross size.
    "max_np_at_host_boundary": (
        UNEVEN,
        1,
        3,
        [
            ("a", 0, 0, 0, 3, 2, 2),
            ("a", 1, 1, 0, 3, 2, 1),
            ("b", 2, 0, 1, 3, 1, 2),
        ],
    ),
    # max_np 2 ends after a: b and c (past max_np) get no ranks.
    "hosts_past_max_np_get_nothing": (
        UNEVEN,
        1,
        2,
        [
            ("a", 0, 0, 0, 2, 2, 1),
            ("a", 1, 1, 0, 2, 2, 1),
        ],
    ),
    # max_np 1: only rank 0 on the first host.
    "max_np_one": (
        UNEVEN,
        1,
        1,
        [("a", 0, 0, 0, 1, 1, 1)],
    ),
    # max_np larger than the slots available: everything, size = total slots.
    "max_np_above_total": (
        [("x", 1), ("y", 1)],
        1,
        8,
        [
            ("x", 0, 0, 0, 2, 1, 2),
            ("y", 1, 0, 1, 2, 1, 2),
        ],
    ),
    # A host with zero slots takes no rank and no cross rank: b is cross_rank 1, not 2.
    "zero_slot_host_in_the_middle": (
        [("a", 2), ("z", 0), ("b", 2)],
        1,
        None,
        [
            ("a", 0, 0, 0, 4, 2, 2),
            ("a", 1, 1, 0, 4, 2, 2),
            ("b", 2, 0, 1, 4, 2, 2),
            ("b", 3, 1, 1, 4, 2, 2),
        ],
    ),
    "zero_slot_host_first": (
        [("z", 0), ("a", 1)],
        1,
        None,
        [("a", 0, 0, 0, 1, 1, 1)],
    ),
    # Order given is the order used: the bigger host second still gets the later ranks.
    "order_is_respected": (
        [("small", 1), ("big", 3)],
        1,
        None,
        [
            ("small", 0, 0, 0, 4, 1, 2),
            ("big", 1, 0, 1, 4, 3, 2),
            ("big", 2, 1, 0, 4, 3, 1),
            ("big", 3, 2, 0, 4, 3, 1),
        ],
    ),
    # Exactly min_np slots is enough.
    "min_np_exactly_met": (
        [("a", 2), ("b", 1)],
        3,
        None,
        [
            ("a", 0, 0, 0, 3, 2, 2),
            ("a", 1, 1, 0, 3, 2, 1),
            ("b", 2, 0, 1, 3, 1, 2),
        ],
    ),
}


@pytest.mark.parametrize(("hosts", "min_np", "max_np", "expected"), list(CASES.values()), ids=list(CASES))
def test_assignment_table(hosts, min_np, max_np, expected):
    assert rows(get_host_assignments(hosts, min_np, max_np)) == expected


def test_ranks_are_contiguous_and_in_host_order():
    assignments = get_host_assignments(UNEVEN, 1)
    assert [s.rank for s in assignments] == [0, 1, 2, 3, 4, 5]
    assert [s.hostname for s in assignments] == ["a", "a", "b", "c", "c", "c"]


def test_max_np_defaults_to_no_limit():
    assert len(get_host_assignments(UNEVEN, 1)) == 6


@pytest.mark.parametrize(
    ("hosts", "min_np", "max_np"),
    [
        ([("a", 2), ("b", 1)], 4, None),  # 3 slots < 4
        ([], 1, None),  # nothing at all
        ([("z", 0), ("y", 0)], 1, None),  # only zero-slot hosts
        ([("a", 4)], 3, 2),  # max_np caps the world below min_np
    ],
    ids=["too_few_slots", "no_hosts", "only_zero_slot_hosts", "max_np_below_min_np"],
)
def test_min_np_not_met_raises_not_enough_slots(hosts, min_np, max_np):
    with pytest.raises(NotEnoughSlots):
        get_host_assignments(hosts, min_np, max_np)


def test_not_enough_slots_is_a_value_error_like_horovods():
    assert issubclass(NotEnoughSlots, ValueError)


def test_slot_info_to_dict_has_every_field():
    slot = get_host_assignments([("a", 1)], 1)[0]
    assert slot.to_dict() == {
        "hostname": "a",
        "rank": 0,
        "local_rank": 0,
        "cross_rank": 0,
        "size": 1,
        "local_size": 1,
        "cross_size": 1,
    }


def test_slot_ids_keep_their_local_rank_across_a_hole():
    """Slot 1 of host a is down (its worker crashed): slot 2 keeps local rank 2, ranks stay dense."""
    assert rows(get_host_assignments([("a", [0, 2]), ("b", 3)], 1)) == [
        ("a", 0, 0, 0, 5, 2, 2),
        ("a", 1, 2, 0, 5, 2, 2),
        ("b", 2, 0, 1, 5, 3, 2),
        ("b", 3, 1, 0, 5, 3, 1),
        ("b", 4, 2, 1, 5, 3, 2),
    ]


def test_slot_ids_and_counts_agree_without_holes():
    assert get_host_assignments([("a", [0, 1]), ("b", [0])], 1, 2) == get_host_assignments([("a", 2), ("b", 1)], 1, 2)


def test_a_slot_exports_torchruns_and_horovodruns_variables() -> None:
    env = round_environment(
        SlotInfo(hostname="host-2", rank=5, local_rank=1, cross_rank=2, size=8, local_size=2, cross_size=4)
    )
    assert env["RANK"] == env["HOROVOD_RANK"] == "5" and env["WORLD_SIZE"] == env["HOROVOD_SIZE"] == "8"
    assert (
        env["LOCAL_RANK"] == env["HOROVOD_LOCAL_RANK"] == "1"
        and env["LOCAL_WORLD_SIZE"] == env["HOROVOD_LOCAL_SIZE"] == "2"
    )
    assert env["GROUP_RANK"] == env["HOROVOD_CROSS_RANK"] == "2" and env["HOROVOD_CROSS_SIZE"] == "4"
    assert env["HOROVOD_HOSTNAME"] == "host-2" and env["HOROVOD_CONTROLLER"] == "gloo"
