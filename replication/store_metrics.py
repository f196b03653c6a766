"""A replicated service's own Prometheus metrics: its role, and etcd's database size read from each member when
scraped.

`elastic_replica_active{service}` is 1 while this replica holds its service's role, 0 while it stands by (the alert
ElasticServiceWithoutActiveReplica fires when every replica of a service that reports stands by).

`elastic_etcd_db_bytes{member}` is the size of a member's database file,
what etcd's `--quota-backend-bytes` caps (at the quota etcd refuses every
write: replication/election.py reclaims the space then); and
`elastic_etcd_db_in_use_bytes{member}` the part of it holding live data (the
rest is free pages that a defragmentation gives back). A member that does not
answer within the timeout is left out of the scrape rather than reported as 0.
The alerts on them are deploy/prometheus/alerts.yml.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from elastic_control_plane.replication.etcd import EtcdClient

STATUS_TIMEOUT = 0.5  # each member's answer, at each scrape
REPLICA_ACTIVE = Gauge(
    "elastic_replica_active",
    "1 while this replica holds its service's role (active), 0 while it stands by.",
    ["service"],
)


class EtcdSizeCollector(Collector):
    def __init__(self, client: EtcdClient) -> None:
        self.client = client

    def collect(self) -> Iterator[GaugeMetricFamily]:
        size = GaugeMetricFamily(
            "elastic_etcd_db_bytes",
            "The size of each etcd member's database file (what --quota-backend-bytes caps).",
            labels=["member"],
        )
        in_use = GaugeMetricFamily(
            "elastic_etcd_db_in_use_bytes",
            "The bytes of each etcd member's database that hold live data (the rest a defragmentation gives back).",
            labels=["member"],
        )
        for endpoint in self.client.endpoints:
            status = self.client.endpoint_status(endpoint, timeout=STATUS_TIMEOUT)
            if status is not None:
                size.add_metric([endpoint], status["db_size"])
                in_use.add_metric([endpoint], status["db_size_in_use"])
        yield size
        yield in_use
