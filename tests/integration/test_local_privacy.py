"""`elasticctl local` is private to its user (issue 46): another Unix user of the machine cannot submit to its control
plane, reach its agents' sockets or read its keys, and nothing of the job listens beyond loopback (the services, the
workers' store), while the same user's `elasticctl status` needs no flag; a run
directory that someone else made, or that is open to others, is refused with one line. The second user is real,
created for the test (CI runs as root)."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_control_plane.bus.config import default_run_dir
from testing.harness import wait_for
from testing.listeners import beyond_loopback, descendants, listening

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RUNUSER = shutil.which("runuser", path="/usr/sbin:/sbin:/usr/bin:/bin") or "runuser"
# The stranger's interpreter: the system's (the virtualenv's own may live where only its owner enters, as under
# /root), given a world-readable copy of what our client imports (the checkout and the virtualenv may sit under a
# directory the stranger cannot enter either).
SYSTEM_PYTHON = "/usr/bin/python3"
LIST_IMPORTS = (
    "import sys, elastic_control_plane.elasticctl.main; "
    "print('\\n'.join(f'{name} {getattr(module, \"__file__\", None)}' for name, module in list(sys.modules.items())))"
)
STRANGER_ELASTICCTL = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'elasticctl'; "
    "runpy.run_module('elastic_control_plane.elasticctl.main', run_name='__main__')"
)


@pytest.fixture
def stranger_site() -> Iterator[Path]:
    """A copy, readable by anyone, of our client's packages and of the virtualenv's packages it imports (removed
    after the test)."""
    found = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True)
    if found.returncode != 0 or found.stdout.decode().strip() != str(sys.version_info[:2]):
        pytest.fail(f"{SYSTEM_PYTHON} is not a Python {sys.version_info[:2]} the second user can run our client with")
    directory = Path(tempfile.mkdtemp(prefix="elastic-stranger-", dir="/tmp"))
    try:
        yield copy_client(directory / "site")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def copy_client(directory: Path) -> Path:
    listing = subprocess.run([sys.executable, "-c", LIST_IMPORTS], capture_output=True, text=True, check=True)
    site_packages = next((BIN.parent / "lib").glob("python3.*/site-packages")).resolve()
    ours = directory / "elastic_control_plane"
    ours.mkdir(parents=True)
    for line in listing.stdout.splitlines():
        name, _, file = line.partition(" ")
        if not file or file == "None" or not Path(file).is_file():
            continue
        path = Path(file).resolve()
        if name.startswith("elastic_control_plane."):  # our packages: each a folder of the checkout
            package = name.split(".")[1]
            source, target = REPO / package, ours / package
        elif path.is_relative_to(site_packages):
            top = path.relative_to(site_packages).parts[0]
            source, target = site_packages / top, directory / top
        else:
            continue
        if target.exists():
            continue
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    for libs in site_packages.glob("*.libs"):  # the shared libraries wheels vendor (pyzmq's libzmq)
        shutil.copytree(libs, directory / libs.name)
    subprocess.run(["chmod", "-R", "a+rX", str(directory.parent)], check=True)
    return directory


def stranger_elasticctl(site: Path, *args: str) -> list[str]:
    """The stranger's own `elasticctl`: our code, run by an interpreter the stranger may execute."""
    return [SYSTEM_PYTHON, "-c", STRANGER_ELASTICCTL, str(site), *args]


@pytest.fixture
def stranger() -> Iterator[pwd.struct_passwd]:
    """Another user of this machine, with no home and no rights beyond any user's."""
    if os.geteuid() != 0:
        pytest.fail("making a second Unix user needs root (CI runs as root)")
    name = f"elastic-{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)


def as_user(user: pwd.struct_passwd, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [RUNUSER, "-u", user.pw_name, "--", *argv],
        env=env,
        cwd="/tmp",
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def elasticctl(*args: str) -> list[str]:
    return [str(BIN / "python"), "-m", "elastic_control_plane.elasticctl.main", *args]


@pytest.fixture
def local_job(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """`elasticctl local` training for minutes, as this user; stopped (SIGTERM, then SIGKILL) after the test."""
    out = tmp_path / "local.out"
    env = {key: value for key, value in os.environ.items() if not key.startswith("ELASTIC_")}
    with out.open("wb") as sink:
        process = subprocess.Popen(
            [
                *elasticctl("local", "--hosts", "1", "--slots", "1", "--"),
                sys.executable,
                "examples/train_elastic.py",
                "--epochs",
                "1000",
                "--step-delay",
                "0.05",
                "--log-dir",
                str(tmp_path / "train"),
            ],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: "running: round 1" in out.read_text(), 120, "the job to run")
        yield process, out
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_another_user_cannot_submit_to_reach_or_read_a_users_elasticctl_local(
    stranger: pwd.struct_passwd, stranger_site: Path, local_job: tuple[subprocess.Popen[bytes], Path]
) -> None:
    process, out = local_job
    own = subprocess.run(elasticctl("status", "--json"), cwd="/tmp", capture_output=True, text=True, timeout=60)
    assert own.returncode == 0, own.stderr
    before = own.stdout

    attempts = {
        "submit": as_user(stranger, *stranger_elasticctl(stranger_site, "run", "--", "sh", "-c", "touch /tmp/owned")),
        "status": as_user(stranger, *stranger_elasticctl(stranger_site, "status")),
        "drain": as_user(stranger, *stranger_elasticctl(stranger_site, "drain", "host-1")),
    }
    for what, attempt in attempts.items():
        assert attempt.returncode != 0, f"{what}: {attempt.stdout}"
        assert "cannot reach the" in attempt.stderr, f"{what}: {attempt.stderr}"

    log_dir = Path(re.search(r"service logs in (\S+)", out.read_text()).group(1))  # type: ignore[union-attr]
    keys = default_run_dir() / "local-keys"
    assert (keys / "client.key_secret").exists()
    for path in (keys / "client.key_secret", default_run_dir() / "agent-host-1.sock", log_dir / "state"):
        probe = as_user(stranger, "sh", "-c", f"ls -l {path} || exit 3")
        assert probe.returncode == 3 and "Permission denied" in probe.stderr, (path, probe.stdout, probe.stderr)

    agent_pids = {
        int(pid)
        for pid in subprocess.run(
            ["pgrep", "-f", "elastic_control_plane.agent.main"], capture_output=True, text=True
        ).stdout.split()
    }
    buffers = [path for pid in agent_pids for path in Path("/dev/shm").glob(f"elastic-snapshot-{pid}-host-1-*")]
    assert len(buffers) == 2 and all(re.search(r"-host-1-[0-9a-f]{16}\.[01]$", str(path)) for path in buffers), buffers
    for buffer in buffers:
        assert buffer.stat().st_mode & 0o777 == 0o600
        stolen = as_user(stranger, "sh", "-c", f"head -c 16 {buffer} > /dev/null || exit 3")
        assert stolen.returncode == 3 and "Permission denied" in stolen.stderr, stolen.stderr

    after = subprocess.run(elasticctl("status", "--json"), cwd="/tmp", capture_output=True, text=True, timeout=60)
    assert after.returncode == 0 and '"job": 1' in after.stdout and '"job": 1' in before, after.stdout
    assert "train_elastic.py" in after.stdout and "/tmp/owned" not in after.stdout
    assert not Path("/tmp/owned").exists()
    assert process.poll() is None, "the job trains on"

    listeners = listening(descendants(process.pid))  # services, agents, fork servers, workers and their store
    assert len(listeners) >= 5, listeners
    assert beyond_loopback(listeners) == [], f"listening where another machine reaches: {listeners}"

    os.killpg(process.pid, signal.SIGTERM)  # stopped mid-epoch, as a supervisor stops it
    process.wait(60)
    assert not [path for path in buffers if path.exists()], "the agent removed its shared-memory files"


def test_a_run_directory_someone_else_made_or_open_to_others_is_refused_in_one_line(
    stranger: pwd.struct_passwd, tmp_path: Path
) -> None:
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    os.chown(planted, stranger.pw_uid, stranger.pw_gid)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    cases = {planted: f"belongs to uid {stranger.pw_uid}, not to you", open_dir: "is open to others (mode 755)"}
    for run_dir, refusal in cases.items():
        env = {**os.environ, "ELASTIC_RUN_DIR": str(run_dir), "ELASTIC_CONTROL": "127.0.0.1"}
        for argv in (
            [str(BIN / "elastic-agent"), "--host", "host-1", "--slots", "1"],
            [str(BIN / "python"), "-m", "elastic_control_plane.services.registry"],
        ):
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1 and refusal in lines[0], (argv, done.stderr)
    assert sorted(os.listdir(planted)) == [], "nothing was put in the planted directory"
    shutil.rmtree(planted)
