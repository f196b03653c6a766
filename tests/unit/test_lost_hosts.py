"""Lost hosts are forgotten in time (services/discovery/lost_hosts.py): a host silent for good leaves discovery's
records ten minutes after it was lost, or once its blacklist's cooldown is over, never before; a host that came
back, or is blacklisted for good, is kept; hosts coming and going leave nothing behind."""

from __future__ import annotations

from elastic_control_plane.services.discovery.hostset import HostSet
from elastic_control_plane.services.discovery.lost_hosts import FORGET_AFTER

LOST_AFTER = 3.0


def lose(hosts: HostSet, name: str, at: float) -> None:
    hosts.register(name, 2, "i", at - LOST_AFTER - 1)
    assert hosts.expire(at, LOST_AFTER) == [name]


def test_a_lost_host_is_forgotten_ten_minutes_later_and_not_before() -> None:
    hosts = HostSet()
    lose(hosts, "gone", 100.0)
    assert hosts.lost.forget_due(hosts.hosts, 100.0 + FORGET_AFTER - 1) == []
    assert hosts.lost.forget_due(hosts.hosts, 100.0 + FORGET_AFTER) == ["gone"]
    assert "gone" not in hosts.hosts and len(hosts.lost) == 0


def test_a_host_that_came_back_or_was_lost_again_later_is_kept_until_its_own_time() -> None:
    hosts = HostSet()
    lose(hosts, "flaky", 100.0)
    hosts.register("flaky", 2, "j", 200.0)
    assert hosts.lost.forget_due(hosts.hosts, 100.0 + FORGET_AFTER) == [], "it came back"
    assert hosts.expire(300.0, LOST_AFTER) == ["flaky"]
    assert hosts.lost.forget_due(hosts.hosts, 300.0 + FORGET_AFTER) == ["flaky"]


def test_a_blacklisted_host_is_forgotten_once_its_cooldown_is_over_and_one_out_for_good_is_kept() -> None:
    hosts = HostSet()
    hosts.cooldown_range = (1000.0, 1000.0)
    lose(hosts, "cooling", 100.0)
    until = hosts.blacklist("cooling", 100.0, "crashed")
    assert until is not None and until > 100.0 + FORGET_AFTER
    assert hosts.lost.forget_due(hosts.hosts, 100.0 + FORGET_AFTER) == []
    assert hosts.lost.forget_due(hosts.hosts, until) == ["cooling"]
    hosts.cooldown_range = None
    lose(hosts, "banned", 2000.0)
    hosts.blacklist("banned", 2000.0, "crashed")
    assert hosts.lost.forget_due(hosts.hosts, 10**9) == [] and "banned" in hosts.hosts


def test_hosts_coming_and_going_for_weeks_leave_nothing_behind() -> None:
    hosts = HostSet()
    for number in range(5000):
        lose(hosts, f"host-{number}", 10.0 * number)
        hosts.lost.forget_due(hosts.hosts, 10.0 * number)
    assert len(hosts.hosts) <= FORGET_AFTER / 10 + 1 and len(hosts.lost) <= FORGET_AFTER / 10 + 1
