"""Horovod's own PyTorch test suite, run against libworker as one elastic job, with per-test outcomes per rank.

    python -m bench.horovod_suite [--tests DIR] [--hosts 2 --slots 1] [--standby N] [-k EXPR] [--timeout S]
                                  [--json PATH]

What it owns: taking Horovod's test files from DIR (by default the unmodified
copy in third_party/horovod/, with Horovod's licence), preparing a throw-away copy that imports
libworker instead of horovod.torch, running it the way Horovod's CI does (every
rank runs the same pytest session; here the ranks are the workers of ONE job
under `elasticctl local`), collecting each rank's junit XML, and printing one
row per test with each rank's outcome, then

    HOROVOD_SUITE hosts=H slots=S passed=N failed=N skipped=N error=N

A test counts as passed only if it passed on every rank; otherwise it counts
as failed if it failed on some rank, else error (a setup/teardown error, or a
rank that never reported it: crashed or timed out), else skipped.

Getting Horovod's files again (the ones this was written against, and
third_party/horovod/ holds: commit 2626dc87a3a8eb8fb7d2216198ce45bce0f9e65a),
from a clone of https://github.com/horovod/horovod:

    mkdir -p /work/hvdtests && cd horovod
    C=2626dc87a3a8eb8fb7d2216198ce45bce0f9e65a
    git show $C:test/parallel/test_torch.py         > /work/hvdtests/test_torch.py
    git show $C:test/parallel/test_adasum_pytorch.py > /work/hvdtests/test_adasum_pytorch.py
    git show $C:test/utils/common.py                 > /work/hvdtests/common.py

DIR holds every `test_*.py` to run plus `common.py`. They are copied into a
fresh temporary directory laid out as Horovod's tree is (`parallel/test_*.py`,
`utils/common.py`, since test_torch.py appends `../utils` to sys.path), and the
only change made to them is the import: `import horovod.torch as X` becomes
`import libworker as X` and `from horovod.torch[.sub] import ...` becomes
`from libworker[.sub] import ...`; every line changed is printed. Any other
`horovod` import left in a test file is reported (it would fail to import).
common.py needs two things from outside: `mock` (a `utils/mock.py` that
re-exports unittest.mock) and `horovod.runner.util.threads.in_thread` (a
`utils/horovod/runner/util/threads.py`, in namespace directories with no
`__init__.py`, so an installed Horovod would still win and `import
horovod.torch` fails instead of finding anything). Nothing else of Horovod is
put on the path. A one-file pytest plugin in the temporary directory
(`-p hvd_suite_progress`) writes each test's start and outcome as JSON lines as
they happen, so a rank that crashes or is stopped by the timeout still tells
which tests it finished and which one it was in.

The job: `elasticctl local --hosts H --slots S --max-restarts 0 --hung-timeout
TIMEOUT [--standby N] -- python -m pytest -p no:cacheprovider -p hvd_suite_progress
-q -rA FILES [-k EXPR]`, started as a user starts one: `python -m MODULE`, so
the agents fork its workers warm and each keeps a standby (the defaults;
`--standby 0` for none). The plugin names each rank's junit XML
(OUT/<ELASTIC_HOST>-<ELASTIC_LOCAL_RANK>.xml) when the session ends, since a
standby learns its slot in init(), and holds a standby's progress records until
it is admitted (one never admitted writes nothing). It records pytest's exit
code next to the XML and turns 1 (tests failed) and 5 (none collected) into
exit 0: a failing test is a result, not a crashed worker, so the agent never
hands the slot to a standby or restarts it to run its session again, and the
other ranks are not aborted (`--max-restarts 0` also keeps a real crash from
rerunning the session). The agents log at INFO, so the job's output tells how
often a standby waited and was admitted, and any line a standby wrote (the
`standbys` of the JSON). The control plane runs on free ports with its run
directory, shared memory directory and TMPDIR inside the temporary directory,
so it does not clash with another `elasticctl local`.
HOROVOD_RANK/HOROVOD_SIZE are not set here: they are libworker's to set in
init(), as horovodrun sets them.

Ending: elasticctl is started in a session (process group) of its own. At the
end, on --timeout, or on Ctrl-C/SIGTERM it is asked to stop (SIGINT: cancel the
job; then SIGTERM; then SIGKILL of its group), and then every process still
carrying this run's marker in its environment (services, agents, workers and
anything they started) is SIGKILLed by pid. Worker output (every line prefixed
`[host:local_rank]` by its agent) goes to `output.log` in the temporary
directory; `--verbose` also shows it live, otherwise only elasticctl's lines and
pytest's progress and summary lines are shown. The temporary directory is
removed at the end unless `--keep`.

Exit code: 0 every test passed on every rank; 1 some test did not pass; 2 the
run itself broke (timeout, a rank without junit XML, elasticctl failed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testing.harness import free_ports, processes_with_env

HOROVOD_COMMIT = "2626dc87a3a8eb8fb7d2216198ce45bce0f9e65a"
VENDORED_TESTS = Path(__file__).resolve().parent.parent / "third_party" / "horovod"
MARKER_VAR = "HVD_SUITE_RUN"
PROGRESS_PLUGIN = "hvd_suite_progress"
OUTCOMES = ("passed", "failed", "skipped", "error")
# A test's overall outcome when it did not pass on every rank: the first of these seen on any rank.
PRIORITY = ("failed", "error", "skipped")
MISSING = "error"  # a rank that never reported a test (it crashed, or the run timed out during/before it)

IMPORT_REWRITES = (
    (re.compile(r"^(\s*)import\s+horovod\.torch\s+as\s+(\w+)\s*$"), r"\1import libworker as \2"),
    (re.compile(r"^(\s*)from\s+horovod\.torch((?:\.\w+)*)\s+import\s+(.*)$"), r"\1from libworker\2 import \3"),
)
OTHER_HOROVOD_IMPORT = re.compile(r"^\s*(?:import|from)\s+(horovod[\w.]*)")
SHIMMED = {"horovod.runner.util.threads"}  # served by the shims below

MOCK_SHIM = '''"""Shim for Horovod's test/utils/common.py (`import mock`): the standard library's unittest.mock."""
from unittest.mock import *  # noqa: F401,F403
from unittest.mock import patch, MagicMock, Mock, call, ANY, DEFAULT, sentinel  # noqa: F401
'''

THREADS_SHIM = '''"""Shim for Horovod's test/utils/common.py: horovod.runner.util.threads.in_thread only."""
import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Run target(*args) in a started thread and return the thread; silent: swallow its exception."""
    def fn(*a):
        try:
            target(*a)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=fn, args=args, name=name)
    thread.daemon = daemon
    thread.start()
    return thread
'''

PROGRESS_PLUGIN_SOURCE = '''"""pytest plugin of bench.horovod_suite: each test's start and outcome as JSON lines."""
import json
import os
import time

import pytest

_out = None
_held = []  # a standby's records, written once it is admitted to a slot (never, when it is not)


def _standby():
    return os.environ.get("ELASTIC_STANDBY") == "1"


def _stem():
    host, local_rank = os.environ.get("ELASTIC_HOST", "unknown"), os.environ.get("ELASTIC_LOCAL_RANK", "x")
    return os.path.join(os.environ["HVD_SUITE_OUT"], "%s-%s" % (host, local_rank))


def _write(record):
    global _out
    record["time"] = time.time()
    _held.append(record)
    if _standby():
        return
    if _out is None:
        _out = open(_stem() + ".jsonl", "a", buffering=1)
    for held in _held:
        _out.write(json.dumps(held) + "\\n")
    _held.clear()
    _out.flush()


def _first_line(report):
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, lineno, reason)
        return str(longrepr[2]).splitlines()[0] if str(longrepr[2]) else ""
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", ""):
        return crash.message.splitlines()[0]
    lines = [line for line in str(longrepr).splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return errors[0] if errors else (lines[-1] if lines else "")


def pytest_runtest_logstart(nodeid, location):
    _write({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report):
    _write({"event": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "xfail": hasattr(report, "wasxfail"), "message": "" if report.passed else _first_line(report),
            "duration": report.duration})


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """First (before junitxml writes): the junit XML goes to this slot's file (named now: a standby learns its slot
    in init()); record pytest's exit code; 1 (tests failed) and 5 (none collected) are results, not a crashed
    worker, so the process exits 0 and the agent neither restarts the slot (rerunning the session) nor aborts the
    others."""
    from _pytest.junitxml import xml_key

    xml = session.config.stash.get(xml_key, None)
    if xml is not None:
        xml.logfile = _stem() + ".xml"
    with open(_stem() + ".rc", "w") as out:
        out.write("%d\\n" % int(exitstatus))
    if int(exitstatus) in (1, 5):
        session.exitstatus = 0


def pytest_collection_finish(session):
    _write({"event": "collected", "nodeids": [item.nodeid for item in session.items]})


def pytest_collectreport(report):
    if report.failed:
        _write({"event": "collect_error", "nodeid": report.nodeid, "message": _first_line(report)})
'''

# Every rank runs this, as a user would: `python -m pytest`, so the agents fork it warm and keep a standby (the
# defaults). The plugin names each rank's junit XML, records pytest's exit code and maps 1 and 5 to 0.
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-p", PROGRESS_PLUGIN, "-q", "-rA", "--junitxml=unnamed.xml"]


# ---------------------------------------------------------------------------------------------------------------
# The temporary copy of Horovod's tests


@dataclass
class Prepared:
    root: Path
    test_files: list[str]  # relative to root
    changes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def rewrite_imports(text: str, name: str, prepared: Prepared) -> str:
    lines = text.splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        body = line.rstrip("\r\n")
        ending = line[len(body) :]
        for pattern, replacement in IMPORT_REWRITES:
            if pattern.match(body):
                new = pattern.sub(replacement, body)
                prepared.changes.append(f"{name}:{number}: {body.strip()}  ->  {new.strip()}")
                lines[number - 1] = new + ending
                break
        else:
            other = OTHER_HOROVOD_IMPORT.match(body)
            if other and other.group(1) in SHIMMED:
                prepared.changes.append(f"{name}:{number}: (unchanged, served by a shim) {body.strip()}")
            elif other:
                prepared.warnings.append(f"{name}:{number}: left as is (no libworker equivalent): {body.strip()}")
    return "".join(lines)


def prepare(tests_dir: Path, root: Path) -> Prepared:
    sources = sorted(tests_dir.glob("test_*.py"))
    if not sources:
        raise SystemExit(
            f"horovod_suite: no test_*.py in {tests_dir} (see the docstring for how to get Horovod's files)"
        )
    common = tests_dir / "common.py"
    if not common.is_file():
        raise SystemExit(f"horovod_suite: {common} is missing (Horovod's test/utils/common.py)")
    prepared = Prepared(root, [])
    (root / "parallel").mkdir(parents=True)
    utils = root / "utils"
    (utils / "horovod" / "runner" / "util").mkdir(parents=True)
    for source in sources:
        target = root / "parallel" / source.name
        target.write_text(rewrite_imports(source.read_text(), source.name, prepared))
        prepared.test_files.append(f"parallel/{source.name}")
    (utils / "common.py").write_text(rewrite_imports(common.read_text(), "common.py", prepared))
    (utils / "mock.py").write_text(MOCK_SHIM)
    (utils / "horovod" / "runner" / "util" / "threads.py").write_text(THREADS_SHIM)
    (root / f"{PROGRESS_PLUGIN}.py").write_text(PROGRESS_PLUGIN_SOURCE)
    (root / "pytest.ini").write_text("[pytest]\n")  # rootdir here; no configuration picked up from above
    return prepared


# ---------------------------------------------------------------------------------------------------------------
# Running the job


class Stop(Exception):
    """SIGTERM to this script: stop the job as on Ctrl-C."""


def _raise_stop(*_: Any) -> None:
    raise Stop()


def elasticctl_command() -> list[str]:
    found = shutil.which("elasticctl")
    return [found] if found else [sys.executable, "-c", "from elasticctl.main import main; main()"]


def interesting(line: str) -> bool:
    """What is shown live without --verbose: elasticctl's own lines, pytest's progress lines and its summaries."""
    if line.startswith("[elasticctl]") or line.startswith("elasticctl:"):
        return True
    body = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
    return bool(
        re.search(r"\[\s*\d+%\]\s*$", body) or re.match(r"=+ .*(passed|failed|error|skipped|no tests ran).* =+$", body)
    )


def kill_marked(marker: str, grace: float = 5.0) -> int:
    """SIGKILL every process carrying this run's marker (all started by this run); how many there were."""
    killed: set[int] = set()
    deadline = time.monotonic() + grace
    while True:
        pids = processes_with_env(marker)
        if not pids:
            return len(killed)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            print(f"horovod_suite: processes still alive after SIGKILL: {pids}", file=sys.stderr)
            return len(killed)
        time.sleep(0.2)


def stop_elasticctl(process: subprocess.Popen[bytes]) -> None:
    """Cancel the job (SIGINT), then SIGTERM, then SIGKILL the whole group."""
    for sig, wait in ((signal.SIGINT, 40.0), (signal.SIGTERM, 30.0)):
        if process.poll() is not None:
            return
        try:
            process.send_signal(sig)
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


@dataclass
class RunResult:
    exit_code: int | None
    timed_out: bool
    interrupted: bool
    wall_s: float
    leftovers: int


def run_job(args: argparse.Namespace, prepared: Prepared, work: Path, results: Path, log_path: Path) -> RunResult:
    marker = uuid.uuid4().hex
    ports = free_ports(5)
    for name in ("run", "shm", "tmp"):
        (work / name).mkdir(mode=0o700)  # the run directory must be private (bus/sockets.py: private_dir)
    env = {
        **os.environ,
        **{
            f"ELASTIC_{name}_ENDPOINT": f"tcp://127.0.0.1:{port}"
            for name, port in zip(("DISCOVERY", "RENDEZVOUS", "REGISTRY", "NOTIFIER", "EVENTS"), ports)
        },
        "ELASTIC_RUN_DIR": str(work / "run"),
        "ELASTIC_SHM_DIR": str(work / "shm"),
        "TMPDIR": str(work / "tmp"),
        "PYTHONUNBUFFERED": "1",
        "ELASTIC_LOG_LEVEL": "INFO",  # the agents' standby_waiting / standby_admitted lines, for `standbys`
        MARKER_VAR: marker,
    }
    options = [
        "--hosts",
        str(args.hosts),
        "--max-restarts",
        "0",
        "--hung-timeout",
        str(args.timeout),
        "--env",
        f"HVD_SUITE_OUT={results}",
    ]
    if args.slots is not None:
        options += ["--slots", str(args.slots)]
    if args.share_gpus:
        options.append("--share-gpus")
    if args.standby is not None:
        options += ["--standby", str(args.standby)]
    pytest_args = list(prepared.test_files) + (["-k", args.k] if args.k else []) + list(args.pytest_args)
    command = [*elasticctl_command(), "local", *options, "--", sys.executable, *PYTEST, *pytest_args]
    print(f"horovod_suite: {shlex.join(command)}", flush=True)
    print(f"horovod_suite: cwd {prepared.root}; worker output in {log_path}", flush=True)

    started = time.monotonic()
    timed_out = interrupted = False
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    process = subprocess.Popen(
        command,
        cwd=prepared.root,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert process.stdout is not None

    def pump() -> None:
        with open(log_path, "w", encoding="utf-8", errors="replace") as log:
            for raw in iter(process.stdout.readline, b""):  # type: ignore[union-attr]
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                if args.verbose or interesting(line):
                    print(line, flush=True)

    reader = threading.Thread(target=pump, name="elasticctl-output", daemon=True)
    reader.start()
    try:
        try:
            process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            print(
                f"horovod_suite: wall-clock timeout after {args.timeout:g}s; stopping the job",
                file=sys.stderr,
                flush=True,
            )
    except (KeyboardInterrupt, Stop):
        interrupted = True
        print("horovod_suite: interrupted; stopping the job", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the stop sequence below runs to its end
        try:
            stop_elasticctl(process)
            leftovers = kill_marked(marker)
            reader.join(timeout=10)
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous)
    if leftovers:
        print(f"horovod_suite: killed {leftovers} leftover process(es) of this run", file=sys.stderr)
    return RunResult(process.returncode, timed_out, interrupted, time.monotonic() - started, leftovers)


# ---------------------------------------------------------------------------------------------------------------
# Results


@dataclass
class Outcome:
    outcome: str
    message: str = ""


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def test_key(classname: str, name: str) -> str:
    """`test_torch.TorchTests::test_x` from junit's classname `parallel.test_torch.TorchTests` and name."""
    return f"{classname.removeprefix('parallel.')}::{name}"


def key_from_nodeid(nodeid: str) -> str:
    """The same key from a pytest node id, as junitxml derives its classname from it."""
    parts = nodeid.split("::")
    parts[0] = parts[0].replace("/", ".").removesuffix(".py")
    return test_key(".".join(parts[:-1]), parts[-1])


def worst(outcomes: list[Outcome]) -> Outcome:
    for kind in PRIORITY:
        for o in outcomes:
            if o.outcome == kind:
                return o
    return outcomes[0] if outcomes else Outcome("passed")


def parse_junit(path: Path) -> dict[str, Outcome]:
    """Each test case's outcome; several entries of one test (a teardown error after a failure) merge, worst first."""
    seen: dict[str, list[Outcome]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = test_key(case.get("classname", ""), case.get("name", ""))
        found = []
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                found.append(Outcome(outcome, first_line(child.get("message")) or first_line(child.text)))
            elif child.tag == "skipped":
                reason = first_line(child.get("message"))
                found.append(Outcome("skipped", f"xfail: {reason}" if child.get("type") == "pytest.xfail" else reason))
        seen.setdefault(key, []).extend(found or [Outcome("passed")])
    return {key: worst([o for o in outs if o.outcome != "passed"] or outs) for key, outs in seen.items()}


def parse_progress(path: Path) -> tuple[dict[str, Outcome], str | None]:
    """Outcomes from the progress plugin's JSON lines (a rank without junit XML), and the test it was in, if any."""
    outcomes: dict[str, list[Outcome]] = {}
    collected: list[str] = []
    running: str | None = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # cut short by a kill
        key = key_from_nodeid(record["nodeid"]) if record.get("nodeid") else None
        if record["event"] == "collected":
            for nodeid in record["nodeids"]:
                collected.append(key_from_nodeid(nodeid))
        elif record["event"] == "start":
            running = key
            outcomes.setdefault(key, [])
        elif record["event"] == "report" and key:
            when, outcome = record["when"], record["outcome"]
            if outcome == "failed":
                outcomes[key].append(Outcome("failed" if when == "call" else "error", record.get("message", "")))
            elif outcome == "skipped":
                reason = record.get("message", "").removeprefix("Skipped: ")
                outcomes[key].append(Outcome("skipped", ("xfail: " if record.get("xfail") else "") + reason))
            elif when == "call":
                outcomes[key].append(Outcome("passed"))
            if when == "teardown":
                running = None
        elif record["event"] == "collect_error":
            outcomes.setdefault(key or record["nodeid"], []).append(
                Outcome("error", "collection: " + record.get("message", ""))
            )
    merged = {}
    for key, outs in outcomes.items():
        if outs:
            merged[key] = worst([o for o in outs if o.outcome != "passed"] or outs)
    if running:
        merged[running] = Outcome(MISSING, "never finished on this rank (it was running when the rank ended)")
    for key in collected:
        merged.setdefault(key, Outcome(MISSING, "not run: the rank ended before it"))
    return merged, running


@dataclass
class Rank:
    name: str  # host:local_rank, as the agents prefix the output
    outcomes: dict[str, Outcome]
    source: str  # "junit", "progress" (no XML), "none"
    pytest_rc: str


def collect(results: Path, hosts: int, slots: int | None) -> list[Rank]:
    stems = {p.stem for p in results.iterdir() if p.suffix in (".xml", ".jsonl", ".rc")}
    if slots is not None:
        stems |= {f"host-{h}-{r}" for h in range(1, hosts + 1) for r in range(slots)}

    def order(stem: str) -> tuple[int, int]:
        match = re.fullmatch(r"host-(\d+)-(\d+)", stem)
        return (int(match.group(1)), int(match.group(2))) if match else (1 << 30, 0)

    ranks = []
    for stem in sorted(stems, key=order):
        host, _, local = stem.rpartition("-")
        rc_file = results / f"{stem}.rc"
        rc = rc_file.read_text().strip() if rc_file.exists() else "none (did not finish)"
        xml, progress = results / f"{stem}.xml", results / f"{stem}.jsonl"
        if xml.exists():
            try:
                ranks.append(Rank(f"{host}:{local}", parse_junit(xml), "junit", rc))
                continue
            except ET.ParseError as exc:
                print(f"horovod_suite: {xml}: {exc}; using the progress log", file=sys.stderr)
        if progress.exists():
            ranks.append(Rank(f"{host}:{local}", parse_progress(progress)[0], "progress", rc))
        else:
            ranks.append(Rank(f"{host}:{local}", {}, "none", rc))
    return ranks


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


STANDBY_LINE = re.compile(r"^\[[^\]\s]+:standby\] ", re.MULTILINE)


def standby_record(output: str) -> dict[str, int]:
    """From the job's output: how often a standby waited in init() and was admitted to a slot (the agents' INFO
    lines), and how many lines a standby wrote as a standby (a standby runs nothing of the session past init())."""
    return {
        "waiting": output.count("standby_waiting"),
        "admitted": output.count("standby_admitted"),
        "output_lines": len(STANDBY_LINE.findall(output)),
    }


def tabulate(ranks: list[Rank], width: int = 140) -> tuple[dict[str, Any], dict[str, int]]:
    names: list[str] = []
    for rank in ranks:
        names += [n for n in rank.outcomes if n not in names]
    tests: dict[str, Any] = {}
    counts = dict.fromkeys(OUTCOMES, 0)
    column = max([len(n) for n in names] + [4])
    cell = max([len(r.name) for r in ranks] + [7])
    print()
    print(f"{'TEST':<{column}}  " + "  ".join(f"{r.name:<{cell}}" for r in ranks) + "  FIRST LINE OF MESSAGE")
    for name in names:
        per_rank = {r.name: r.outcomes.get(name, Outcome(MISSING, "not reported by this rank")) for r in ranks}
        values = list(per_rank.values())
        overall = "passed" if all(o.outcome == "passed" for o in values) else worst(values).outcome
        counts[overall] += 1
        tests[name] = {
            "overall": overall,
            "ranks": {k: {"outcome": o.outcome, "message": o.message} for k, o in per_rank.items()},
        }
        messages = {k: o.message for k, o in per_rank.items() if o.message}
        if len(set(messages.values())) == 1 and len(messages) == len(per_rank):
            shown = clip(next(iter(messages.values())), width)
        else:
            each = max(50, width // max(1, len(messages)))
            shown = " | ".join(f"{k}: {clip(m, each)}" for k, m in messages.items())
        print(
            f"{name:<{column}}  " + "  ".join(f"{o.outcome:<{cell}}" for o in values) + (f"  {shown}" if shown else "")
        )
    return tests, counts


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog="Arguments after `--` go to pytest as they are."
    )
    parser.add_argument(
        "--tests",
        type=Path,
        default=VENDORED_TESTS,
        help="Directory with Horovod's test_*.py and common.py (default: the copy in third_party/horovod).",
    )
    parser.add_argument("--hosts", type=int, default=2, help="Agents (hosts) of the local cluster (default 2).")
    parser.add_argument("--slots", type=int, default=1, help="Slots (ranks) per host (default 1).")
    parser.add_argument("-k", dest="k", default=None, help="pytest -k expression.")
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="Wall-clock limit of the job in seconds (default 1800)."
    )
    parser.add_argument("--json", type=Path, default=None, help="Write the outcomes here.")
    parser.add_argument("--share-gpus", action="store_true", help="Passed to elasticctl local (more ranks than GPUs).")
    parser.add_argument(
        "--standby", type=int, default=None, help="Passed to elasticctl local (default: the agents' own default)."
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="Show every worker line live, not only progress.")
    parser.add_argument(
        "--keep", action="store_true", help="Keep the temporary directory (tests, junit XML, output.log, service logs)."
    )
    parser.add_argument("pytest_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.tests.is_dir():
        parser.error(f"--tests {args.tests}: not a directory")

    work = Path(tempfile.mkdtemp(prefix="horovod-suite-"))
    try:
        prepared = prepare(args.tests.resolve(), work / "tests")
        print(
            f"horovod_suite: Horovod tests from {args.tests} (written against horovod@{HOROVOD_COMMIT[:12]}), "
            f"copied to {prepared.root}"
        )
        for change in prepared.changes:
            print(f"horovod_suite: import {change}")
        for warning in prepared.warnings:
            print(f"horovod_suite: WARNING {warning}", file=sys.stderr)
        results = work / "results"
        results.mkdir()
        run = run_job(args, prepared, work, results, work / "output.log")
        ranks = collect(results, args.hosts, args.slots)
        tests, counts = tabulate(ranks)
        print()
        for rank in ranks:
            print(
                f"horovod_suite: rank {rank.name}: pytest exit code {rank.pytest_rc}, outcomes from "
                f"{rank.source}, {len(rank.outcomes)} test(s)"
            )
        broken = (
            run.timed_out
            or run.interrupted
            or run.exit_code != 0
            or any(r.source != "junit" for r in ranks)
            or not ranks
        )
        how = (
            "timed out"
            if run.timed_out
            else "interrupted"
            if run.interrupted
            else f"elasticctl exit code {run.exit_code}"
        )
        print(f"horovod_suite: job {how}; wall time {run.wall_s:.1f}s")
        standbys = standby_record((work / "output.log").read_text(errors="replace"))
        print(
            f"horovod_suite: standbys waiting {standbys['waiting']}, admitted {standbys['admitted']}, "
            f"lines written by a standby {standbys['output_lines']}"
        )
        print(
            f"HOROVOD_SUITE hosts={args.hosts} slots={args.slots} " + " ".join(f"{k}={v}" for k, v in counts.items()),
            flush=True,
        )
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "horovod_commit": HOROVOD_COMMIT,
                        "hosts": args.hosts,
                        "slots": args.slots,
                        "k": args.k,
                        "elasticctl_exit_code": run.exit_code,
                        "timed_out": run.timed_out,
                        "interrupted": run.interrupted,
                        "wall_s": round(run.wall_s, 1),
                        "import_changes": prepared.changes,
                        "ranks": {r.name: {"pytest_exit_code": r.pytest_rc, "source": r.source} for r in ranks},
                        "summary": counts,
                        "standbys": standbys,
                        "tests": tests,
                    },
                    indent=2,
                )
                + "\n"
            )
        if broken:
            return 2
        return 0 if counts["passed"] == len(tests) and tests else 1
    finally:
        if args.keep:
            print(f"horovod_suite: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
