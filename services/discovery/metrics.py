"""Discovery's Prometheus metrics (bus/metrics.py serves them): `elastic_discovery_hosts{state}`, set every second
from the loop, and `elastic_discovery_heartbeats_total{status}`."""

from prometheus_client import Counter, Gauge

from elastic_control_plane.services.discovery.hostset import (
    ACTIVE,
    BLACKLISTED,
    DRAINING,
    LOST,
    UNHEALTHY,
    UNLISTED,
    WARMING,
)

METRICS_INTERVAL = 1.0
HOSTS_BY_STATE = Gauge("elastic_discovery_hosts", "Hosts known to discovery, by state (set every second).", ["state"])
HEARTBEATS = Counter(
    "elastic_discovery_heartbeats",
    "Agent heartbeats received, by answer: ok, unknown (register again), lost.",
    ["status"],
)
HEARTBEATS_BY_STATUS = {status: HEARTBEATS.labels(status) for status in ("ok", "unknown", "lost")}  # looked up once


def count_hosts_by_state(states: list[str]) -> None:
    for state in (ACTIVE, LOST, DRAINING, BLACKLISTED, WARMING, UNLISTED, UNHEALTHY):
        HOSTS_BY_STATE.labels(state).set(states.count(state))
