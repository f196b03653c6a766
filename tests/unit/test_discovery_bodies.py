"""services/discovery/bodies.py: what discovery reads in a request's body, and the malformed bodies it refuses with
bad_request before anything changes."""

from __future__ import annotations

import pytest

from elastic_control_plane.bus.service import RequestError
from elastic_control_plane.services.discovery import bodies
from elastic_control_plane.services.discovery.hostset import Mark


def test_a_blacklist_end_in_wall_clock_time_becomes_one_on_discoverys_clock() -> None:
    raw = {
        "h1": {"draining": False, "blacklisted": True, "until": 1030.0, "count": 2, "reason": "crashed"},
        "h2": {"draining": True, "blacklisted": False, "until": None, "count": 0, "reason": ""},
    }
    found = bodies.marks(raw, local_now=50.0, wall_now=1000.0)
    assert found["h1"] == Mark(False, True, 80.0, 2, "crashed")
    assert found["h2"] == Mark(True, False, float("inf"), 0, ""), "no end: blacklisted for good"


def test_reports_are_read_field_by_field() -> None:
    body = {
        "down": [1],
        "down_version": 3,
        "snapshot": {"commit": 4, "bytes": 10, "written_at": 2},
        "fork_server": {"state": "ready", "reason": "x" * 600},
    }
    assert bodies.down_slots(body) == ([1], 3)
    assert bodies.snapshots(body) == {"snapshot": {"commit": 4, "bytes": 10, "written_at": 2.0}}
    assert bodies.fork_server(body) == {"state": "ready", "reason": "x" * bodies.MAX_REASON}
    assert bodies.warm(body) is True and bodies.fork_server({}) is None
    assert bodies.settings({"max_np": 4, "cooldown": [1, 2]}) == bodies.Settings(4, None, (1.0, 2.0))
    assert bodies.expected([["h", [0, 1]]]) == [("h", (0, 1))]


@pytest.mark.parametrize(
    ("read", "body"),
    [
        (bodies.down_slots, {"down": [-1], "down_version": 1}),
        (bodies.down_slots, {"down": [True], "down_version": 1}),
        (bodies.snapshots, {"snapshot": {"commit": -1, "bytes": 0, "written_at": 0}}),
        (bodies.snapshots, {"checkpoint": {"commit": 1, "bytes": 0, "written_at": 0, "path": "p" * 5000}}),
        (bodies.fork_server, {"fork_server": {"state": "busy"}}),
        (bodies.warm, {"warm": "yes"}),
        (bodies.settings, {"cooldown": [1]}),
        (bodies.settings, {"max_np": "4"}),
        (bodies.expected, [["h", [-1]]]),
    ],
)
def test_a_malformed_body_is_bad_request(read, body) -> None:
    with pytest.raises(RequestError) as refused:
        read(body)
    assert refused.value.code == "bad_request"


def test_a_heartbeat_that_repeats_the_kept_reports_is_the_same_and_any_change_is_not() -> None:
    snapshot = {"commit": 4, "bytes": 10, "written_at": 2.0}
    checkpoint = {"commit": 3, "bytes": 10, "written_at": 1.0, "path": "/ckpt/3"}
    fork_server = {"state": "ready", "reason": ""}
    body = {"host": "h1", "snapshot": dict(snapshot), "checkpoint": dict(checkpoint), "fork_server": dict(fork_server)}
    kept = bodies.snapshots(body)
    assert bodies.same_reports(body, kept, bodies.fork_server(body))
    assert bodies.same_reports({"host": "h1"}, {}, None), "an agent that reports nothing, again"
    assert not bodies.same_reports({**body, "snapshot": {**snapshot, "commit": 5}}, kept, fork_server)
    assert not bodies.same_reports({**body, "checkpoint": None}, kept, fork_server)
    assert not bodies.same_reports({**body, "fork_server": {"state": "off", "reason": ""}}, kept, fork_server)
    assert not bodies.same_reports({**body, "snapshot": "junk"}, kept, fork_server), "checked again, then refused"
