"""The Kubernetes client's retry policy (services/discovery/kubernetes_retry.py): waits that double with jitter up to
a cap, a Retry-After honoured up to the cap, and what each failure is said as and whether it leads to a list."""

from __future__ import annotations

import random
from email.utils import formatdate

import pytest

from elastic_control_plane.services.discovery.kubernetes_retry import (
    Backoff,
    RetryPolicy,
    failure_event,
    leads_to_relist,
    retry_after_seconds,
)
from elastic_control_plane.services.discovery.pods import Forbidden, KubernetesError, Unauthorized, Unavailable


def test_waits_double_up_to_the_cap_each_within_half_its_step_and_start_again_after_a_reset() -> None:
    backoff = Backoff(RetryPolicy(first=1.0, cap=8.0, jitter=0.5), random.Random(5))
    steps = [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    waits = [backoff.wait() for _ in steps]
    for wait, step in zip(waits, steps):
        assert 0.5 * step <= wait <= min(8.0, 1.5 * step), (waits, steps)
    assert len(set(waits[3:])) == 3, "at the cap, still jittered"
    backoff.reset()
    assert 0.5 <= backoff.wait() <= 1.5


def test_the_default_policy_waits_0_8_s_doubling_to_30_s() -> None:
    assert RetryPolicy() == RetryPolicy(first=0.8, cap=30.0, jitter=0.5, rewatches=3)
    backoff = Backoff()
    waits = [backoff.wait() for _ in range(12)]
    assert 0.4 <= waits[0] <= 1.2 and all(15.0 <= wait <= 30.0 for wait in waits[6:]), waits


def test_a_retry_after_is_waited_instead_up_to_the_cap_and_the_step_still_doubles() -> None:
    backoff = Backoff(RetryPolicy(first=1.0, cap=8.0), random.Random(5))
    assert backoff.wait(retry_after=3.0) == 3.0
    assert backoff.wait(retry_after=120.0) == 8.0
    assert 2.0 <= backoff.wait() <= 6.0, "the third step: 4 s within ±50 %"


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("3", 3.0), ("120", 120.0), ("0", None), ("", None), (None, None), ("soon", None), ("-1", None)],
)
def test_retry_after_headers_in_seconds(header: str | None, seconds: float | None) -> None:
    assert retry_after_seconds(header) == seconds


def test_retry_after_headers_as_http_dates() -> None:
    now = 1_800_000_000.0
    assert retry_after_seconds(formatdate(now + 10, usegmt=True), now=now) == pytest.approx(10.0)
    assert retry_after_seconds(formatdate(now - 10, usegmt=True), now=now) is None, "already past"


@pytest.mark.parametrize(
    ("failure", "event", "relist"),
    [
        (Unauthorized("https://api", "/token", "Unauthorized"), "kubernetes_unauthorized", False),
        (Forbidden("watch", "ml"), "kubernetes_forbidden", False),
        (Unavailable(429, 1.0, "HTTP 429"), "kubernetes_throttled", False),
        (Unavailable(503, None, "HTTP 503"), "kubernetes_unavailable", True),
        (Unavailable(504, None, "HTTP 504"), "kubernetes_unavailable", True),
        (KubernetesError("https://api: connection refused"), "kubernetes_unreachable", True),
        (ConnectionResetError(), "kubernetes_unreachable", True),
        (ValueError("not JSON"), "kubernetes_bad_answer", True),
    ],
)
def test_each_failure_has_its_event_and_only_those_a_list_may_mend_lead_to_one(
    failure: Exception, event: str, relist: bool
) -> None:
    assert (failure_event(failure), leads_to_relist(failure)) == (event, relist)
