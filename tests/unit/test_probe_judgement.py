"""The collective probe's pure parts: the judgement of a probe's times (the slow host held, the others and the noise
spared), the agent's check of what discovery asks, and discovery's check of what an agent reports."""

from __future__ import annotations

import pytest

from elastic_control_plane.agent.collective_probe import valid_assignment
from elastic_control_plane.bus.service import RequestError
from elastic_control_plane.services.discovery import bodies
from elastic_control_plane.services.discovery.collective_probe import MIN_EXCESS, judge


def timed(**seconds: float) -> dict[str, dict]:
    return {host.replace("_", "-"): {"seconds": value, "error": None} for host, value in seconds.items()}


def test_the_host_many_times_slower_than_the_others_median_is_held_and_named_and_the_others_pass() -> None:
    holds = judge(timed(host_1=0.10, host_2=0.12, host_3=1.5), [], 3.0)
    assert holds["host-1"] is None and holds["host-2"] is None
    assert holds["host-3"] == "collective probe: 1.50s, 13.6x the others' median (0.11s)"


def test_hosts_alike_all_pass_even_when_all_are_slow() -> None:
    assert set(judge(timed(host_1=2.0, host_2=2.1, host_3=1.9), [], 3.0).values()) == {None}


def test_a_ratio_over_the_factor_within_the_noise_floor_is_spared() -> None:
    small = MIN_EXCESS / 2
    assert judge(timed(host_1=0.01, host_2=0.01, host_3=0.01 + small), [], 3.0)["host-3"] is None


def test_a_host_entering_alone_is_judged_against_the_times_of_the_hosts_in_the_job() -> None:
    assert judge(timed(host_4=0.11), [0.10, 0.12], 3.0) == {"host-4": None}
    assert judge(timed(host_4=0.9), [0.10, 0.12], 3.0)["host-4"].startswith("collective probe: 0.90s, 8.2x")


def test_a_host_alone_with_nothing_to_compare_with_passes() -> None:
    assert judge(timed(host_1=5.0), [], 3.0) == {"host-1": None}


def test_a_failed_or_missing_result_holds_its_host_with_the_reason_and_spares_the_rest() -> None:
    results = {**timed(host_1=0.1, host_2=0.1), "host-3": {"seconds": None, "error": "no result within 15s"}}
    holds = judge(results, [], 3.0)
    assert holds == {"host-1": None, "host-2": None, "host-3": "collective probe failed: no result within 15s"}


@pytest.mark.parametrize(
    "asked",
    [
        None,
        "probe",
        {"id": 1, "rank": 2, "size": 2, "store": "h:1"},
        {"id": 1, "rank": 0, "size": 2, "store": "no-port"},
        {"id": True, "rank": 0, "size": 1, "store": "h:1"},
        {"id": 1, "rank": 0, "size": 1, "store": "h:1" * 200},
    ],
)
def test_the_agent_ignores_an_ask_that_is_not_a_probe(asked: object) -> None:
    assert valid_assignment(asked) is None


def test_the_agent_keeps_only_the_four_values_of_a_probe() -> None:
    asked = {"id": 7, "rank": 1, "size": 3, "store": "10.0.0.1:4000", "command": "rm -rf /"}
    assert valid_assignment(asked) == {"id": 7, "rank": 1, "size": 3, "store": "10.0.0.1:4000"}


@pytest.mark.parametrize(
    "report", ["x", {"store": 7}, {"id": "1"}, {"seconds": -1.0}, {"collective_s": True}, {"error": 3}]
)
def test_discovery_refuses_a_malformed_probe_report(report: object) -> None:
    with pytest.raises(RequestError, match="health.probe"):
        bodies.probe(report)


def test_discovery_keeps_a_probe_report_with_its_error_cut_short() -> None:
    kept = bodies.probe({"store": "h:1", "id": 3, "seconds": 0.2, "collective_s": 0.1, "error": "e" * 10_000})
    assert kept["store"] == "h:1" and kept["seconds"] == 0.2 and len(kept["error"]) == bodies.MAX_REASON
