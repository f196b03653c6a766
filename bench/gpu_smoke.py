"""GPU smoke run of the real system (issue 8, GPUs), for a host with CUDA; with `--cpu`, what resets cost a surviving
worker on any host.

    python -m bench.gpu_smoke [--kills 3] [--cpu]

(a) shared GPU: two agents (host-1, host-2, one slot each, `--share-gpus`) put
    two ranks on the same GPU, so their CUDA tensors go through gloo;
    `bench/gpu_worker.py` trains a small CUDA model in Horovod's idiom. Each
    kill sends SIGKILL to host-2's worker mid-run and waits until the job is
    back at size 2 and stepping (host-2 returns after a 1 s blacklist
    cooldown). Every rank logs CUDA memory, resident memory (RSS), threads and
    open fds at each round entry; growth is measured on host-1's rank, which
    lives through every reset, from its first entry after a reset (momentum
    buffers and gradients exist by then) to its last.
(b) NCCL: one rank on one GPU trains to the end on the NCCL backend.

`ok` says both ran as they should (jobs succeeded, every kill recovered, the
expected backends); `recovery_s` is the median from a kill to the first step
back at size 2; the growth numbers say whether resets give back what they
held. The last line is `GPU_SMOKE ok=...`. Without CUDA it prints
`GPU_SMOKE skipped: no CUDA` and exits 0.

With `--cpu` the GPUs are hidden (`CUDA_VISIBLE_DEVICES` empty) and (a) runs
with the workers training on the CPU (`--device cpu`, backend gloo, CUDA
memory logged as 0); (b) is skipped. The last line is
`RESET_RESOURCES device=cpu kills=N recovery_s=... fds_growth=...
threads_growth=... rss_growth_bytes=... ok=...`.

Every process started here is stopped on the way out, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import cluster
from elastic_control_plane.agent.gpus import gpu_devices
from testing.harness import Cluster, read_events, wait_for

WORKER = [
    sys.executable,
    "-m",
    "bench.gpu_worker",
]  # as a module: run as a file, bench/ comes first on the path and bench/snapshot.py hides the snapshot package
COOLDOWN = "1"
CPU_BACKEND, SHARED_BACKEND, NCCL_BACKEND = "gloo", "cpu:gloo,cuda:gloo", "cpu:gloo,cuda:nccl"
RESOURCES = ("memory_allocated", "memory_reserved", "device_used", "rss", "threads", "fds")


def events(log_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == kind]


def running_pid(c: Cluster, host: str) -> int:
    def find() -> int | None:
        for w in c.call("registry", "status")["workers"]:
            if w["host"] == host and w["state"] == "RUNNING":
                return int(w["pid"])
        return None

    return wait_for(find, 120, f"a running worker on {host}")


def steps_at_size_2(
    log_dir: Path, job: subprocess.Popen[bytes], after: float, round_after: int, count: int
) -> list[dict[str, Any]]:
    """Wait for `count` steps at world size 2 in a round after `round_after`, after `after`; the job must run on."""

    def matching() -> list[dict[str, Any]]:
        return [e for e in events(log_dir, "step") if e["time"] > after and e["size"] == 2 and e["round"] > round_after]

    wait_for(
        lambda: job.poll() is not None or len(matching()) >= count,
        180,
        f"{count} steps at size 2 after round {round_after}",
    )
    if job.poll() is not None:
        raise AssertionError(f"the job ended with exit code {job.returncode} while waiting for {count} steps at size 2")
    return matching()


def resets(gpu: str | None, kills: int) -> dict[str, Any]:
    """Scenario (a) on GPU `gpu`, or on the CPU when None; returns the recovery times and the entries of the rank that
    lived through every reset."""
    if gpu is None:
        visible, agent_args, device, backend, where = "", [], "cpu", CPU_BACKEND, "CPU"
    else:
        visible, agent_args, device, backend, where = gpu, ["--share-gpus"], "cuda", SHARED_BACKEND, f"shared GPU {gpu}"
    with cluster({"CUDA_VISIBLE_DEVICES": visible}) as c:
        try:
            c.start_agent("host-1", 1, agent_args)
            c.start_agent("host-2", 1, agent_args)
            log_dir, stop = c.workdir / "train", c.workdir / "stop"
            print(f"(a) {where}: 2 ranks, logs in {log_dir}")
            job = c.submit(
                "--min-np",
                "2",
                "--blacklist-cooldown",
                COOLDOWN,
                COOLDOWN,
                "--",
                *WORKER,
                "--device",
                device,
                "--steps",
                "1000000",
                "--log-dir",
                str(log_dir),
                "--stop-file",
                str(stop),
            )
            steps_at_size_2(log_dir, job, 0.0, 0, 20)
            recoveries = []
            for kill in range(1, kills + 1):
                pid = running_pid(c, "host-2")
                round_before = c.job()["round"]
                killed = time.time()
                os.kill(pid, signal.SIGKILL)
                recovered = steps_at_size_2(log_dir, job, killed, round_before, 10)
                recoveries.append(recovered[0]["time"] - killed)
                print(
                    f"  kill {kill}: host-2's worker (pid {pid}) in round {round_before}; back at size 2, "
                    f"stepping, after {recoveries[-1]:.2f} s (round {recovered[0]['round']})"
                )
            stop.touch()
            code = c.wait_job_end(job, 120)
            print(f"  job exit code {code}")
            entries = events(log_dir, "enter")
            survivor_pid = next((e["pid"] for e in entries if e["host"] == "host-1"), None)
            survivor = [e for e in entries if e["pid"] == survivor_pid]
            return {
                "ok": code == 0 and len(survivor) > kills and {e["backend"] for e in entries} == {backend},
                "recoveries": recoveries,
                "survivor": survivor,
                "entries": entries,
            }
        except (AssertionError, OSError) as exc:
            print(f"  failed: {exc}\n{c.dump_logs()}")
            return {"ok": False, "recoveries": [], "survivor": [], "entries": []}


def nccl(device: str, steps: int) -> bool:
    """Scenario (b): one rank trains `steps` steps on NCCL and the job succeeds."""
    with cluster({"CUDA_VISIBLE_DEVICES": device}) as c:
        try:
            c.start_agent("host-1", 1)
            log_dir = c.workdir / "train"
            print(f"(b) NCCL on GPU {device}: 1 rank, logs in {log_dir}")
            job = c.submit("--", *WORKER, "--device", "cuda", "--steps", str(steps), "--log-dir", str(log_dir))
            code = c.wait_job_end(job, 300)
            backends = {e["backend"] for e in events(log_dir, "enter")}
            done = events(log_dir, "done")
            print(
                f"  job exit code {code}, backends {sorted(backends)}, finished at step "
                f"{done[-1]['batch'] if done else None}"
            )
            return code == 0 and backends == {NCCL_BACKEND} and bool(done) and done[-1]["batch"] == steps
        except (AssertionError, OSError) as exc:
            print(f"  failed: {exc}\n{c.dump_logs()}")
            return False


def growth(survivor: list[dict[str, Any]]) -> dict[str, int]:
    """Change of each resource between the surviving rank's first entry after a reset and its last entry."""
    if len(survivor) < 3:
        return {}
    return {key: survivor[-1][key] - survivor[1][key] for key in RESOURCES}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=3, help="Workers killed in scenario (a).")
    parser.add_argument("--nccl-steps", type=int, default=100)
    parser.add_argument("--cpu", action="store_true", help="Train on the CPU and skip the NCCL run.")
    args = parser.parse_args()
    if args.kills < 2:
        parser.error("--kills must be at least 2: growth is measured from the first entry after a reset to the last")
    if not args.cpu and not torch.cuda.is_available():
        print("GPU_SMOKE skipped: no CUDA")
        return
    gpu = None if args.cpu else (gpu_devices() or ["0"])[0]
    shared = resets(gpu, args.kills)
    print("  round entries of host-1's rank (it lives through every reset):")
    for e in shared["survivor"]:
        print(
            f"    round {e['round']:>3} size {e['size']} step {e['batch']:>5}  "
            + "  ".join(f"{key} {e[key]}" for key in RESOURCES)
        )
    for pid in sorted({e["pid"] for e in shared["entries"] if e["host"] == "host-2"}):
        first = next(e for e in shared["entries"] if e["pid"] == pid)
        print(
            f"    host-2 pid {pid} first entry (round {first['round']}): "
            + "  ".join(f"{key} {first[key]}" for key in RESOURCES)
        )
    changed = growth(shared["survivor"])
    print(
        "  growth over resets: "
        + ("  ".join(f"{key} {value:+d}" for key, value in changed.items()) or "not measured (fewer than 3 entries)")
    )
    recovery = statistics.median(shared["recoveries"]) if shared["recoveries"] else float("nan")
    growths = (
        f"fds_growth={changed.get('fds', 'nan')} threads_growth={changed.get('threads', 'nan')} "
        f"rss_growth_bytes={changed.get('rss', 'nan')}"
    )
    if gpu is None:
        ok = shared["ok"] and bool(changed)
        print(f"RESET_RESOURCES device=cpu kills={args.kills} recovery_s={recovery:.2f} {growths} ok={ok}")
    else:
        ok = nccl(gpu, args.nccl_steps) and shared["ok"] and bool(changed)
        print(
            f"GPU_SMOKE ok={ok} recovery_s={recovery:.2f} "
            f"mem_growth_bytes={changed.get('memory_allocated', 'nan')} {growths}"
        )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
