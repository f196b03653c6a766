"""A worker's tqdm progress bar through its agent (issue 45): shown live, prefixed with its slot, while it runs; the
agent's memory flat over 10,000 redraws of a line that never ends with a newline."""

from __future__ import annotations

import sys
from pathlib import Path

from testing.harness import Cluster, rss_bytes, wait_for

RSS_GROWTH_ALLOWED = 4 * 1024 * 1024  # far below what holding 10,000 redraws of the bar would take (~1 MB + resplits)


def test_a_tqdm_bar_is_shown_live_and_prefixed_and_the_agent_holds_none_of_it(cluster: Cluster, tmp_path: Path) -> None:
    halfway, go = tmp_path / "halfway", tmp_path / "go"
    agent = cluster.start_agent("host-1", 1)
    job = cluster.submit("--min-np", "1", "--", sys.executable, "tests/workers/progress_bar.py", str(halfway), str(go))
    wait_for(halfway.exists, 120, "the bar halfway")
    wait_for(lambda: "5000/10000" in cluster.output("agent-host-1"), 10, "the bar's redraw at step 5000 shown")
    shown = cluster.output("agent-host-1")
    redraws = [part for part in shown.replace("\n", "\r").split("\r") if "train:" in part]
    assert all(part.startswith("[host-1:0] ") for part in redraws), redraws[:3]
    assert len(redraws) > 1_000, "every redraw goes out as it comes, none held back until the bar's end"
    at_halfway = rss_bytes(agent.pid)
    go.touch()
    wait_for(lambda: "trained 10000 steps" in cluster.output("agent-host-1"), 120, "the loop's end")
    assert rss_bytes(agent.pid) - at_halfway < RSS_GROWTH_ALLOWED
    assert cluster.wait_job_end(job, 60) == 0, cluster.output("elasticctl-run")
    assert "10000/10000" in cluster.output("agent-host-1")
