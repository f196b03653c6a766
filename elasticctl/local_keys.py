"""The keys of `elasticctl local`'s control plane: made for each run, private to its user, found by the user's other
elasticctl commands while the run lives.

Each run makes a server and a client keypair (bus/sockets.py's `generate_keys`)
in `local-keys/` of the user's run directory (bus/config.py's
`default_run_dir`, checked private by `private_dir`: 0700, the user's own),
with the run's pid in `local-keys/owner`. Its services and agents require
them (CURVE on loopback too), so another user of the machine, who cannot
read the directory, cannot call them: not submit, not publish, not drain.
The same user's `elasticctl status`, `drain` or `events` in another terminal
uses them when given no `--keys` (ELASTIC_KEYS) and the control plane is on
loopback, for as long as the run's process lives; the run removes them when
it ends.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from elastic_control_plane.bus.config import default_run_dir
from elastic_control_plane.bus.lifetime import alive
from elastic_control_plane.bus.sockets import SecurityError, generate_keys, private_dir
from elastic_control_plane.elasticctl.control import CommandError

LOCAL_KEYS = "local-keys"
OWNER = "owner"


def _keys_dir() -> Path:
    return private_dir(default_run_dir(), "ELASTIC_RUN_DIR") / LOCAL_KEYS


def live_local_keys() -> Path | None:
    """The keys of this user's running `elasticctl local`, if one runs: found only in directories that are this
    user's alone (the run directory and local-keys/ in it), so keys another user planted where this user's
    elasticctl looks are never presented to anyone."""
    run_dir = default_run_dir()
    keys = run_dir / LOCAL_KEYS
    if not all(_private(path) for path in (run_dir, keys)):
        return None
    try:
        owner = int((keys / OWNER).read_text())
    except (OSError, ValueError):
        return None
    return keys if alive(owner) else None


def _private(path: Path) -> bool:
    """A directory (not a symlink) of this user that no one else may enter; False too when it is missing."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def make_local_keys() -> Path:
    """Fresh keys for this run (CommandError when another run of this user's still holds them)."""
    running = live_local_keys()
    if running is not None:
        raise CommandError(f"another elasticctl local runs (pid {(running / OWNER).read_text()}); stop it first")
    try:
        keys = _keys_dir()
    except SecurityError as exc:
        raise CommandError(str(exc), 2) from None
    shutil.rmtree(keys, ignore_errors=True)
    keys.mkdir(mode=0o700)
    generate_keys(keys)
    (keys / OWNER).write_text(str(os.getpid()))
    return keys


def remove_local_keys(keys: Path) -> None:
    shutil.rmtree(keys, ignore_errors=True)
