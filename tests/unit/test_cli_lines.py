"""The lines of elasticctl's following commands: one line per notifier event (`elasticctl events`), the two
outage lines and the retry pace (`run`, `status --watch`, `events --follow`), and the in-place redraw of a
terminal (`status --watch`)."""

from __future__ import annotations

from datetime import datetime

from elastic_control_plane.elasticctl.control import ControlPlaneUnreachable
from elastic_control_plane.elasticctl.events import NO_TIME, event_line, format_value
from elastic_control_plane.elasticctl.outage import UNREACHABLE, Outage
from elastic_control_plane.elasticctl.watch import redraw_in_place

AT = datetime(2026, 11, 23, 15, 4, 5, 123000).timestamp()


def test_a_round_shows_its_size_and_slots_per_host_in_rank_order_and_leaves_the_plumbing_out() -> None:
    body = {
        "round": 3,
        "hosts": [["host-1", [0, 1]], ["host-2", [0, 1]]],
        "size": 4,
        "command": ["python", "train.py"],
        "cwd": "/work",
        "env": {"A": "1"},
        "job": 1,
        "job_key": "abc",
        "max_restarts": 3,
        "seq": 12,
        "incarnation": "f00",
    }
    assert (
        event_line("round", body, AT)
        == "2026-11-23 15:04:05.123 seq=12 round round=3 size=4 hosts=host-1:2,host-2:2 job=1"
    )


def test_history_without_a_time_gets_a_placeholder_of_the_same_shape_and_a_stamp_wins_over_arrival() -> None:
    body = {
        "job": 1,
        "state": "failed",
        "exit_code": 3,
        "reason": "rank 1 on host-1 exited with code 3",
        "seq": 7,
        "incarnation": "f00",
    }
    assert (
        event_line("job_finished", body, None)
        == f'{NO_TIME} seq=7 job_finished job=1 state=failed exit_code=3 reason="rank 1 on host-1 exited with code 3"'
    )
    assert len(NO_TIME) == len("2026-11-23 15:04:05.123") and len(NO_TIME.split()) == 2
    assert (
        event_line("abort", {"round": 2, "seq": 8, "time": AT}, None) == "2026-11-23 15:04:05.123 seq=8 abort round=2"
    )
    assert event_line("abort", {"round": 2, "seq": 8, "time": AT}, AT + 60).startswith("2026-11-23 15:04:05.123 ")


def test_hosts_updated_uses_its_own_timestamp_and_abbreviates_a_long_host_list() -> None:
    hosts = [[f"host-{i}", [0, 1]] for i in range(1, 8)]
    body = {"timestamp": AT, "added": True, "removed": False, "hosts": hosts, "seq": 3, "incarnation": "f00"}
    assert (
        event_line("hosts_updated", body, None)
        == "2026-11-23 15:04:05.123 seq=3 hosts_updated added=true removed=false "
        "hosts=host-1:2,host-2:2,host-3:2,host-4:2,...+3"
    )


def test_hosts_updated_shows_its_diff_hosts_set_then_hosts_removed() -> None:
    body = {
        "timestamp": AT,
        "version": 4,
        "added": True,
        "removed": True,
        "set": [["host-9", [0, 1, 2]]],
        "remove": ["host-2"],
        "seq": 3,
    }
    assert (
        event_line("hosts_updated", body, None)
        == "2026-11-23 15:04:05.123 seq=3 hosts_updated added=true removed=true changed=+host-9:3,-host-2"
    )


def test_an_event_type_not_known_here_shows_its_fields_sorted() -> None:
    body = {"zeta": "a b", "alpha": [1, 2], "empty": "", "nested": {"k": "v"}, "seq": 4, "incarnation": "f00"}
    assert (
        event_line("something_new", body, AT)
        == '2026-11-23 15:04:05.123 seq=4 something_new alpha=1,2 empty="" nested={"k":"v"} zeta="a b"'
    )
    assert event_line("kill_worker", {"host": "host-1", "local_rank": 0, "pid": 42, "seq": 5}, AT).endswith(
        "seq=5 kill_worker host=host-1 local_rank=0 pid=42"
    )


def test_a_hung_worker_shows_why_without_its_stack_and_a_straggler_its_cost() -> None:
    reason = "hung: the others waited 3.4s for rank 2 (limit 3.0s, no progress for 3.3s)"
    hung = {"host": "h", "local_rank": 1, "rank": 2, "pid": 7, "reason": reason, "stack": "Thread 0x1\n" * 500}
    assert event_line("worker_hung", {**hung, "seq": 6}, AT).endswith(
        f'seq=6 worker_hung host=h local_rank=1 rank=2 reason="{reason}"'
    )
    straggler = {"host": "h", "local_rank": 0, "rank": 1, "lost_s_per_min": 10.2, "seq": 7}
    assert event_line("straggler", straggler, AT).endswith(
        "seq=7 straggler host=h local_rank=0 rank=1 lost_s_per_min=10.2"
    )


def test_values_are_single_tokens() -> None:
    assert [format_value(v) for v in (None, [], 0, 1.5, False, "plain", "x=y", 'say "hi"')] == [
        "-",
        "-",
        "0",
        "1.5",
        "false",
        "plain",
        '"x=y"',
        '"say \\"hi\\""',
    ]
    assert format_value({"k": "v" * 100}).endswith("...") and len(format_value({"k": "v" * 100})) == 60


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_said_once_when_it_starts_and_once_when_it_ends_with_its_length_and_retries_back_off() -> None:
    clock, said = Clock(), []
    outage = Outage(said.append, clock)
    outage.answered()
    assert said == [] and outage.lasted() == 0.0
    waits = []
    for _ in range(6):
        waits.append(
            outage.failed(ControlPlaneUnreachable("registry", "tcp://127.0.0.1:5552", silent_since=clock.now - 2))
        )
        clock.now += 2
    assert waits == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    assert said == [f"{UNREACHABLE} (no reply from the registry at tcp://127.0.0.1:5552)"]
    assert outage.lasted() == 14.0
    outage.answered()
    outage.answered()
    assert said[1:] == ["[elasticctl] control plane reachable again after 14.0s"]
    assert (
        outage.failed(
            ControlPlaneUnreachable("notifier", "tcp://h:5553", silent_since=clock.now), silent_since=clock.now - 3
        )
        == 0.25
    )
    assert outage.lasted() == 3.0 and len(said) == 3


def test_a_terminal_frame_overwrites_the_previous_one_in_place() -> None:
    assert redraw_in_place("a\nbb") == "\x1b[Ha\x1b[K\nbb\x1b[K\n\x1b[J"
