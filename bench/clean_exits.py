"""Clean ends (issue 24): many short jobs in a row, counting every worker that did not exit 0 at the job's end.

    python -m bench.clean_exits [--jobs 50] [--standby 1] [--epochs 1] [--repo DIR]

Each job is the README's kind of run, `elasticctl local --hosts 2 --slots 2
--standby N -- python examples/horovod_elastic.py --epochs E --samples 512`,
the way a new user starts one. After each job it reads the registry's log in
the job's run directory (every `worker_exited` with its exit code) and the
job's output (any `terminate called` line, which a C++ thread left joinable at
exit prints before SIGABRT). `--repo` runs another checkout of this project
(its code on PYTHONPATH, its directory as cwd), to compare a commit with
another on the same machine.

The last line: `CLEAN_EXITS jobs=N failed_jobs=F aborts=A nonzero_exits=X
terminate_lines=T seconds_per_job=S`; every count but `jobs` should be 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RUN_DIR = re.compile(r"service logs in (\S+)")


@dataclass
class JobEnd:
    exit_code: int
    worker_exit_codes: list[int]
    terminate_lines: int


def run_job(repo: Path, standby: int, epochs: int) -> JobEnd:
    command = [
        sys.executable,
        "-m",
        "elastic_control_plane.elasticctl.main",
        "local",
        "--hosts",
        "2",
        "--slots",
        "2",
        "--standby",
        str(standby),
        "--",
        sys.executable,
        "examples/horovod_elastic.py",
        "--epochs",
        str(epochs),
        "--samples",
        "512",
    ]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    found = RUN_DIR.search(output)
    codes: list[int] = []
    if found:
        run_dir = Path(found.group(1))
        for line in (run_dir / "registry.log").read_text().splitlines():
            if '"worker_exited"' in line:
                codes.append(int(json.loads(line)["exit_code"]))
        shutil.rmtree(run_dir, ignore_errors=True)
    return JobEnd(done.returncode, codes, output.count("terminate called"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--standby", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    started = time.monotonic()
    ends: list[JobEnd] = []
    for number in range(1, args.jobs + 1):
        end = run_job(args.repo.resolve(), args.standby, args.epochs)
        ends.append(end)
        print(
            f"job {number}: exit {end.exit_code}, workers exited {end.worker_exit_codes}, 'terminate called' "
            f"lines {end.terminate_lines}",
            flush=True,
        )
    codes = [code for end in ends for code in end.worker_exit_codes]
    print(
        f"CLEAN_EXITS jobs={len(ends)} failed_jobs={sum(end.exit_code != 0 for end in ends)} aborts={codes.count(-6)} "
        f"nonzero_exits={sum(code != 0 for code in codes)} terminate_lines={sum(end.terminate_lines for end in ends)} "
        f"seconds_per_job={(time.monotonic() - started) / max(1, len(ends)):.1f}"
    )


if __name__ == "__main__":
    main()
