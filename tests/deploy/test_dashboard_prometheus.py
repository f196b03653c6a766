"""The Grafana dashboard's queries against a real Prometheus (Debian's `prometheus`) scraping a real local run: the
four services and two agents serve their metrics, a job trains and one of its workers is killed (a reset, a
recovery), and every panel's query then returns data. A query naming a metric nobody exports, or a label the
metrics do not have, returns nothing and fails here."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from testing.harness import REPO, SERVICES, Cluster, free_ports, wait_for, worker_pid

DASHBOARD = REPO / "deploy" / "grafana" / "elastic.json"


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.fail("prometheus is not installed (apt-get install prometheus; .ci/run installs it)")
    return found


def queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel.get("targets", [])]


def query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return json.loads(answer.read())["data"]["result"]
    except OSError:
        return []


def test_every_dashboard_panel_returns_data_from_a_real_prometheus(tmp_path: Path) -> None:
    ports = dict(zip([*SERVICES, "host-1", "host-2", "prometheus"], free_ports(len(SERVICES) + 3)))
    cluster = Cluster(tmp_path)
    prometheus = None
    try:
        cluster.start_services({name: ["--metrics-port", str(ports[name])] for name in SERVICES})
        for host in ("host-1", "host-2"):
            cluster.start_agent(host, 1, ["--metrics-port", str(ports[host])])
        config = tmp_path / "prometheus.yml"
        targets = [f"127.0.0.1:{port}" for name, port in ports.items() if name != "prometheus"]
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"scrape_configs: [{{job_name: elastic, static_configs: [{{targets: {json.dumps(targets)}}}]}}]\n"
        )
        with open(tmp_path / "prometheus.log", "wb") as log:
            prometheus = subprocess.Popen(
                [
                    prometheus_binary(),
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        train = [sys.executable, "examples/train_elastic.py", "--epochs", "200", "--step-delay", "0.02"]
        job = cluster.submit("--min-np", "2", "--", *train, "--log-dir", str(tmp_path / "train"))
        wait_for(lambda: (cluster.job()["state"], cluster.job()["size"]) == ("running", 2), 60, "the job on 2 hosts")
        os.kill(worker_pid(cluster, "host-2", 0), signal.SIGKILL)  # a reset, and its recovery
        wait_for(lambda: cluster.job()["resets"] >= 1 and cluster.job()["size"] == 2, 60, "the job back at size 2")
        for title, expr in queries():
            wait_for(lambda expr=expr: query(ports["prometheus"], expr), 60, f"data for panel {title!r}: {expr}")
        cluster.call("registry", "cancel", {"reason": "the test ends"})
        cluster.wait_job_end(job, 60)
    finally:
        if prometheus is not None:
            os.killpg(prometheus.pid, signal.SIGKILL)
            prometheus.wait()
        cluster.close()
