"""How hard one running elastic job asks slurmctld (issue 59: discovery polled squeue and sinfo every 0.5 s), on a
real 3-node Slurm (scripts/slurm.sh, started and stopped here).

    python -m bench.slurm_rpcs [--window 60]

For each discovery poll (0.5 s, the former default, as the baseline; today's default), one 2-node job is submitted and
left to train; once it trains, slurmctld's RPC statistics are reset (`sdiag -r`) and read again `--window` seconds
later (nothing else asks Slurm meanwhile: the bench only reads the job's own event log). Printed per poll: the
requests made (REQUEST_* but sdiag's own; slurmd's registrations are not the job's), per minute, and every RPC by
type; the last line the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
from pathlib import Path

from testing.harness import read_events, wait_for
from testing.slurm_cluster import SlurmCluster, running_slurm, slurm

JOB = ["-N", "2", "--", "python", "counter.py", "--batches", "100000", "--step-delay", "0.05", "--log-dir", "log"]


def rpcs_by_type() -> dict[str, int]:
    """sdiag's 'Remote Procedure Call statistics by message type': {type: count}."""
    text = slurm("sdiag")
    section = text.split("Remote Procedure Call statistics by message type", 1)[1].split("Remote Procedure Call")[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s+(\S+)\s+\(\s*\d+\) count:(\d+)", section, re.M)}


def measure(poll: str | None, window: float) -> dict[str, int]:
    with tempfile.TemporaryDirectory(prefix="elastic-rpcs-") as user_dir:
        cluster = SlurmCluster(Path(user_dir))
        try:
            cluster.submit(*JOB, env={"ELASTIC_SLURM_POLL": poll} if poll is not None else {})
            wait_for(lambda: sum(e["event"] == "commit" for e in read_events(cluster.user_dir / "log")) > 20, 180,
                     "the job to train", interval=0.5)  # fmt: skip
            subprocess.run(["sdiag", "-r"], check=True, capture_output=True)
            time.sleep(window)  # the window measured: nothing of the bench asks Slurm during it
            return rpcs_by_type()
        finally:
            cluster.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=60.0)
    args = parser.parse_args()
    per_minute = {}
    with running_slurm():
        for name, poll in (("baseline", "0.5"), ("now", None)):
            counts = measure(poll, args.window)
            asked = sum(n for kind, n in counts.items() if kind.startswith("REQUEST_") and kind != "REQUEST_STATS_INFO")
            per_minute[name] = asked * 60 / args.window
            print(f"{name} (poll {poll or 'default'}): {asked} requests in {args.window:g} s "
                  f"({per_minute[name]:.0f}/min); every RPC by type: {counts}")  # fmt: skip
    print(f"RPCS per_min_baseline={per_minute['baseline']:.0f} per_min_now={per_minute['now']:.0f} "
          f"ratio={per_minute['now'] / per_minute['baseline']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
