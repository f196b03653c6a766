"""Host snapshots (issue 9): what a commit into the snapshot costs against a clone, and how fast a job gets back.

    python -m bench.snapshot [--mib 192] [--repeats 5] [--kills 3] [--job-mib 64] [--standby 0]

1. commit cost, in this process: a stack of Linear layers plus Adam's state,
   `--mib` MiB in all (parameters, exp_avg, exp_avg_sq), after one optimizer
   step, in a one-rank gloo world whose buffer files lie in /dev/shm. Best and
   median of `--repeats` after one warm-up, of
       clone           `t.clone()` of every tensor of the model's and optimizer's state_dicts
       copy_ into kept `kept.copy_(t)` into tensors allocated once (memory bandwidth: no page faults)
       commit, writer  `TorchState.commit()` writing the host's snapshot
       commit, copy    `TorchState.commit()` of a rank that does not write it (deepcopy, as Horovod)
       host update check  `check_host_updates()` alone, the part of a commit that is no copy
       read back       `host_snapshot()`: verify the newest buffer's checksum and copy its tensors out (a restore)
2. worker kill: host-1 with 2 slots and host-2 with 1 run tests/workers/counter.py
   with a `--job-mib` MiB buffer in its state; `--kills` times, host-1's
   local rank 1 (not the host's snapshot writer) is SIGKILLed. From the kill:
   the registry records the failure, the job's first commit after recovery
   (the survivors, in a later round), the agent starts the replacement, the
   replacement is ready (its imports done: the agent's `slot_ready`), the
   round of size 3 starts, the replacement enters training, its first commit.
3. whole-job resume: host-1 and host-2 with 1 slot each run the plain counter;
   `--kills` times both workers are SIGKILLed at once; the same parts up to
   the resumed job's first commit, and the batch it resumed at.

`--standby N` gives every agent N standby processes (already imported, waiting
in `init()`); each kill then waits for fresh standbys before the next. Jobs run
with `--restart-window 1`, so every kill is a slot's first crash
(restarted at once, without the crash-loop backoff of 1, 2, 4 ... s). The
clusters keep their snapshots in /dev/shm, as real agents do; every process
started here is killed and every buffer file removed on the way out, on errors
and Ctrl-C too. The last line is `SNAPSHOT mib=... commit_s=... clone_s=...
commit_vs_clone=...` (best of the repeats) `worker_recovery_s=...
replacement_s=... job_resume_s=...` (medians of the kills).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import cluster
from elastic_control_plane.snapshot import copying, layout
from elastic_control_plane.snapshot.tree import split
from libworker.elastic import snapshots
from libworker.elastic.state import TorchState
from libworker.world import world
from testing.harness import Cluster, read_events, wait_for

SHM = Path("/dev/shm")
WIDTH = 1024
COUNTER = [sys.executable, "tests/workers/counter.py", "--batches", "1000000", "--step-delay", "0.02"]
JOB_OPTIONS = ["--min-np", "2", "--max-restarts", "100", "--restart-window", "1", "--blacklist-cooldown", "1", "1"]


def _model(mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear(1024, 1024) layers whose parameters are a third of `mib`, and Adam after one step (the other two)."""
    layers = max(1, round((mib << 20) / 3 / 4 / (WIDTH * WIDTH + WIDTH)))
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, WIDTH)).sum().backward()
    optimizer.step()
    return model, optimizer


@contextlib.contextmanager
def _one_rank_world(prefix: str) -> Iterator[None]:
    """A one-rank gloo world whose only rank writes the host's snapshot, slots at `prefix` (removed on the way out)."""
    world.slot = {
        "rank": 0,
        "size": 1,
        "local_rank": 0,
        "local_size": 1,
        "cross_rank": 0,
        "cross_size": 1,
        "round": 1,
        "hosts_timestamp": 100.0,
        "hostname": "bench",
        "snapshot_writer": True,
    }
    world.round = 1
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    os.environ.update(ELASTIC_SNAPSHOT=prefix, ELASTIC_JOB_KEY="bench-snapshot")
    try:
        layout.create(prefix)
        yield
    finally:
        world.slot["snapshot_writer"] = True
        writer = snapshots.writer()
        if writer is not None:
            writer.close()
        layout.remove(prefix)
        for name in ("ELASTIC_SNAPSHOT", "ELASTIC_JOB_KEY"):
            os.environ.pop(name, None)
        dist.destroy_process_group()


def _timed(action: Callable[[], Any], repeats: int) -> list[float]:
    action()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return times


def commit_cost(mib: int, repeats: int) -> dict[str, list[float]]:
    model, optimizer = _model(mib)
    tensors = split({"model": model.state_dict(), "optimizer": optimizer.state_dict()})[1]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(
        f"commit cost: {len(tensors)} tensors, {nbytes / 2**20:.1f} MiB (model + Adam), native copy: "
        f"{copying.native_available()}, "
        f"{copying.THREADS} copy threads, best and median of {repeats} after one warm-up"
    )
    with _one_rank_world(str(SHM / f"elastic-snapshot-{os.getpid()}-bench")):
        state = TorchState(model=model, optimizer=optimizer, batch=0)
        kept = [t.clone() for t in tensors]
        times = {
            "clone": _timed(lambda: [t.clone() for t in tensors], repeats),
            "copy_ into kept": _timed(lambda: [k.copy_(t) for k, t in zip(kept, tensors)], repeats),
            "commit, writer": _timed(state.commit, repeats),
        }
        world.slot["snapshot_writer"] = False
        times["commit, copy"] = _timed(state.commit, repeats)
        times["host update check"] = _timed(state.check_host_updates, repeats)
        times["read back"] = _timed(snapshots.host_snapshot, repeats)
    clone = min(times["clone"])
    for name, values in times.items():
        best = min(values)
        rate = f"{nbytes / best / 1e9:6.2f} GB/s  {best / clone:5.2f} x clone" if name != "host update check" else ""
        print(f"  {name:<18} best {best:7.4f} s  median {statistics.median(values):7.4f} s  {rate}")
    ratio = min(times["commit, writer"]) / clone
    print(f"  commit as writer / clone (best): {ratio:.2f} (goal <= 1.25): {'met' if ratio <= 1.25 else 'NOT met'}")
    return times


def _running(c: Cluster) -> dict[tuple[str, int], int]:
    return {
        (w["host"], w["local_rank"]): int(w["pid"])
        for w in c.call("registry", "status")["workers"]
        if w["state"] == "RUNNING"
    }


def _events(log_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == kind]


def _first(
    log_dir: Path, kind: str, what: str, match: Callable[[dict[str, Any]], bool], timeout: float = 90.0
) -> dict[str, Any]:
    return wait_for(lambda: next((e for e in _events(log_dir, kind) if match(e)), None), timeout, what, interval=0.2)


def _steady(c: Cluster, log_dir: Path, size: int, after: float) -> dict[tuple[str, int], int]:
    """Wait until every rank of a round of `size` has committed after `after`, then 1 s more; the running workers."""

    def ready() -> bool:
        commits = [e for e in _events(log_dir, "commit") if e["time"] > after and e["size"] == size]
        return bool(commits) and len({e["rank"] for e in commits if e["round"] == commits[-1]["round"]}) == size

    wait_for(ready, 120, f"every rank of a round of size {size} to commit", interval=0.2)
    time.sleep(1.0)
    return wait_for(lambda: r if len(r := _running(c)) == size else None, 30, f"{size} running workers")


@contextlib.contextmanager
def _shm_cluster() -> Iterator[Cluster]:
    """A bench cluster whose agents keep their snapshots in /dev/shm; their buffer files go with it."""
    agents: list[int] = []
    try:
        with cluster({"ELASTIC_SHM_DIR": str(SHM)}) as c:
            try:
                yield c
            finally:
                agents = [p.pid for name, p in c.processes.items() if name.startswith("agent")]
                with contextlib.suppress(Exception):
                    c.call("registry", "cancel", {"reason": "benchmark done"})
                    c.wait_job_end(c.processes["elasticctl-run"], 20)
    finally:
        for pid in agents:
            for path in SHM.glob(f"elastic-snapshot-{pid}-*"):
                path.unlink(missing_ok=True)


def _logged(c: Cluster, name: str, event: str, after: float, **match: Any) -> float:
    """Seconds from `after` to the first `event` in a process's JSON log after `after` with the fields `match`."""
    for line in c.output(name).splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            stamp = datetime.fromisoformat(
                record.get("timestamp", "1970-01-01T00:00:00+00:00").replace("Z", "+00:00")
            ).timestamp()
            if record.get("event") == event and stamp > after and all(record.get(k) == v for k, v in match.items()):
                return stamp - after
    return float("nan")


def _started(c: Cluster, host: str, after: float) -> float:
    """Seconds from `after` until the host's agent started a replacement or gave the slot to a standby."""
    times = [
        t
        for event in ("worker_started", "standby_admitted")
        if not math.isnan(t := _logged(c, f"agent-{host}", event, after))
    ]
    return min(times, default=float("nan"))


def _standbys_waiting(c: Cluster, hosts: list[str], after: float) -> None:
    """Wait until each host's agent has a standby waiting again (started after `after`, imports done)."""
    wait_for(
        lambda: all(not math.isnan(_logged(c, f"agent-{h}", "standby_waiting", after)) for h in hosts),
        90,
        "standbys waiting",
        interval=0.2,
    )


def _snapshot_bytes(c: Cluster, host: str) -> int:
    header = layout.newest_header(
        layout.buffer_paths(str(SHM / f"elastic-snapshot-{c.processes[f'agent-{host}'].pid}-{host}"))
    )
    return header.payload_length if header is not None else 0


def worker_kill(kills: int, job_mib: int, standby: int) -> tuple[dict[str, list[float]], int]:
    parts: dict[str, list[float]] = {
        "failure recorded": [],
        "first commit after recovery": [],
        "replacement started": [],
        "replacement ready (imported)": [],
        "round of size 3 started": [],
        "replacement entered": [],
        "replacement first commit": [],
    }
    with _shm_cluster() as c:
        c.start_agent("host-1", 2, ["--standby", str(standby)])
        c.start_agent("host-2", 1, ["--standby", str(standby)])
        log_dir = c.workdir / "train"
        c.submit(*JOB_OPTIONS, "--", *COUNTER, "--mib", str(job_mib), "--log-dir", str(log_dir))
        running = _steady(c, log_dir, 3, 0.0)
        if standby:
            _standbys_waiting(c, ["host-1", "host-2"], 0.0)
        size = _snapshot_bytes(c, "host-1")
        for _ in range(kills):
            victim = running[("host-1", 1)]
            round_before = max(e["round"] for e in _events(log_dir, "commit"))
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            after = _first(
                log_dir, "commit", "a commit after recovery", lambda e: e["time"] > killed and e["round"] > round_before
            )
            entered = _first(
                log_dir,
                "enter",
                "the replacement to enter",
                lambda e: e["time"] > killed and e["pid"] not in running.values(),
            )
            first = _first(log_dir, "commit", "the replacement's commit", lambda e: e["pid"] == entered["pid"])
            parts["failure recorded"].append(_logged(c, "registry", "worker_failed", killed))
            parts["first commit after recovery"].append(after["time"] - killed)
            parts["replacement started"].append(_started(c, "host-1", killed))
            parts["replacement ready (imported)"].append(_logged(c, "agent-host-1", "slot_ready", killed))
            parts["round of size 3 started"].append(_logged(c, "registry", "round_started", killed, size=3))
            parts["replacement entered"].append(entered["time"] - killed)
            parts["replacement first commit"].append(first["time"] - killed)
            print(
                f"  kill {len(parts['failure recorded'])}: recovered at batch {after['batch']} (size {after['size']}), "
                f"replacement entered at batch {entered['batch']}",
                flush=True,
            )
            running = _steady(c, log_dir, 3, first["time"])
            if standby:
                _standbys_waiting(c, ["host-1"], killed)
        restored = c.output("agent-host-1").count("restored commit")
        print(f"  replacements that restored from host-1's snapshot: {restored} of {kills}")
    return parts, size


def job_resume(kills: int, standby: int) -> tuple[dict[str, list[float]], int]:
    parts: dict[str, list[float]] = {
        "failure recorded": [],
        "replacements started": [],
        "replacements ready (imported)": [],
        "round started": [],
        "resumed ranks entered": [],
        "first commit after resume": [],
    }
    with _shm_cluster() as c:
        for host in ("host-1", "host-2"):
            c.start_agent(host, 1, ["--standby", str(standby)])
        log_dir = c.workdir / "train"
        c.submit(*JOB_OPTIONS, "--", *COUNTER, "--log-dir", str(log_dir))
        running = _steady(c, log_dir, 2, 0.0)
        if standby:
            _standbys_waiting(c, ["host-1", "host-2"], 0.0)
        size = _snapshot_bytes(c, "host-1")
        for _ in range(kills):
            killed = time.time()
            for pid in running.values():
                os.kill(pid, signal.SIGKILL)
            last = max(e["batch"] for e in _events(log_dir, "commit") if e["time"] <= killed)
            old = set(running.values())
            first = _first(
                log_dir, "commit", "a commit after the resume", lambda e: e["time"] > killed and e["pid"] not in old
            )
            entered = [e for e in _events(log_dir, "enter") if e["time"] > killed and e["pid"] not in old]
            parts["failure recorded"].append(_logged(c, "registry", "worker_failed", killed))
            parts["replacements started"].append(max(_started(c, host, killed) for host in ("host-1", "host-2")))
            parts["replacements ready (imported)"].append(
                max(_logged(c, f"agent-{host}", "slot_ready", killed) for host in ("host-1", "host-2"))
            )
            parts["round started"].append(_logged(c, "registry", "round_started", killed))
            parts["resumed ranks entered"].append(max(e["time"] for e in entered) - killed)
            parts["first commit after resume"].append(first["time"] - killed)
            print(
                f"  kill {len(parts['failure recorded'])}: last commit logged before the kill {last}, resumed at batch "
                f"{sorted({e['batch'] for e in entered})}",
                flush=True,
            )
            running = _steady(c, log_dir, 2, first["time"])
            if standby:
                _standbys_waiting(c, ["host-1", "host-2"], killed)
    return parts, size


def _report(title: str, parts: dict[str, list[float]]) -> None:
    print(title)
    for name, values in parts.items():
        if all(math.isnan(v) for v in values):
            continue  # e.g. no `slot_ready` when a standby takes the slot
        print(
            f"  {name:<30} median {statistics.median(values):6.3f} s  max {max(values):6.3f} s  samples "
            f"{', '.join(f'{v:.3f}' for v in values)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=192, help="Model + Adam state of the in-process commit timing, MiB.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed commits and clones (after one warm-up).")
    parser.add_argument("--kills", type=int, default=3, help="Kills in each of the worker and the whole-job scenario.")
    parser.add_argument(
        "--job-mib", type=int, default=64, help="Extra state of the worker-kill job (counter.py --mib), MiB."
    )
    parser.add_argument("--standby", type=int, default=0, help="Standby processes per agent (elastic-agent --standby).")
    args = parser.parse_args()
    times = commit_cost(args.mib, args.repeats)
    print(
        f"\nworker kill (host-1 x 2 slots + host-2 x 1, --standby {args.standby}, counter job with --mib "
        f"{args.job_mib}), "
        f"host-1's local rank 1 killed {args.kills} times",
        flush=True,
    )
    worker, worker_bytes = worker_kill(args.kills, args.job_mib, args.standby)
    _report(f"  snapshot {worker_bytes / 2**20:.1f} MiB; from the kill:", worker)
    print(
        f"\nwhole-job resume (host-1 + host-2 x 1 slot, --standby {args.standby}, plain counter job), both "
        f"workers killed {args.kills} times",
        flush=True,
    )
    resume, resume_bytes = job_resume(args.kills, args.standby)
    _report(f"  snapshot {resume_bytes} bytes; from the kill:", resume)
    commit, clone = min(times["commit, writer"]), min(times["clone"])
    print(
        f"\nSNAPSHOT mib={args.mib} standby={args.standby} commit_s={commit:.4f} clone_s={clone:.4f} "
        f"commit_vs_clone={commit / clone:.2f} "
        f"worker_recovery_s={statistics.median(worker['first commit after recovery']):.3f} "
        f"replacement_s={statistics.median(worker['replacement first commit']):.3f} "
        f"job_resume_s={statistics.median(resume['first commit after resume']):.3f}"
    )


if __name__ == "__main__":
    main()
