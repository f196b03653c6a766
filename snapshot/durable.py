"""Durable copies of a host's snapshot (`--checkpoint-dir`): flushed atomically, verified, the last two kept.

A checkpoint is a buffer's bytes as they are (same header, payload and
checksum), at `DIR/<host>/commit-<N>.snap`. The agent flushes in a background
thread: it copies the newest buffer out of shared memory, verifies the copy
(the buffer may be overwritten while it is read; then the flush is skipped and
retried at the next commit), writes it to a temporary file, fsyncs it, renames
it into place and fsyncs the directory, then removes all but the newest two.
A crash at any point leaves the earlier checkpoints complete. Checkpoints are
the agent's user's only: files 0600 in directories made 0700 (a checkpoint's
metadata may be unpickled when a job resumes from it: snapshot/store.py refuses
a file another user wrote, or could have, and `trusted_checkpoint_files` a
directory another user owns or may write; a flush refuses to write into one).
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastic_control_plane.snapshot import copying
from elastic_control_plane.snapshot.layout import PAYLOAD_START, BufferHeader, newest_header, read_header

KEEP = 2
_NAME = re.compile(r"^commit-(\d+)\.snap$")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    commit: int
    nbytes: int
    seconds: float
    written_at: float


def untrusted_directory(path: Path, follow: bool = True) -> str | None:
    """Why a checkpoint directory (`follow`: the one the user named, maybe through a symlink) or a host's directory
    in it (not followed) is not to be written or resumed from, or None: it must be a directory of this user that no
    one else may write (a checkpoint's metadata may be unpickled: whoever could plant a file there could run code in
    the job)."""
    try:
        info = path.stat() if follow else path.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot look at it: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory" if follow or not stat.S_ISLNK(info.st_mode) else "it is a symlink"
    if info.st_uid != os.getuid():
        return f"it belongs to uid {info.st_uid}, not to you (uid {os.getuid()})"
    if info.st_mode & 0o022:
        return f"others may write it (mode {info.st_mode & 0o777:o}): chmod go-w it"
    return None


def trusted_checkpoint_files(directory: Path, reject: Callable[[str, str], None]) -> list[Path]:
    """`checkpoint_files` of the directory and of each host's directory that `untrusted_directory` passes;
    `reject(path, reason)` hears of each one passed over."""
    why = untrusted_directory(directory)
    if why is not None:
        reject(str(directory), why)
        return []
    hosts = sorted({path.parent for path in directory.glob("*/commit-*.snap")})
    trusted = []
    for host_dir in hosts:
        why = untrusted_directory(host_dir, follow=False)
        if why is None:
            trusted += checkpoint_files(directory, host_dir.name)
        else:
            reject(str(host_dir), why)
    return sorted(trusted, key=lambda path: -int(_NAME.match(path.name).group(1)))  # type: ignore[union-attr]


def checkpoint_files(directory: Path, host: str = "*") -> list[Path]:
    """Every checkpoint file under `directory` (of all hosts, or of `host`), newest commit first."""
    found = [
        (int(m.group(1)), path) for path in directory.glob(f"{host}/commit-*.snap") if (m := _NAME.match(path.name))
    ]
    return [path for _, path in sorted(found, key=lambda cp: -cp[0])]


def flush(buffers: tuple[str, str], directory: Path, host: str, after_commit: int) -> Checkpoint | None:
    """Write the newest buffer newer than `after_commit` to `directory/host/`; None when there is nothing newer or the
    buffer changed while it was read. OSError (disk full, permissions) reaches the caller."""
    started = time.monotonic()
    header = newest_header(buffers)
    if header is None or header.commit <= after_commit:
        return None
    path = next(p for p in buffers if read_header(p) == header)
    data = _read_verified(path, header)
    if data is None:
        return None
    target_dir = directory / host
    target_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    why = untrusted_directory(directory) or untrusted_directory(target_dir, follow=False)
    if why is not None:
        raise PermissionError(f"checkpoint directory {target_dir} is not written: {why}")
    target = target_dir / f"commit-{header.commit:012d}.snap"
    partial = target_dir / f".{target.name}.{os.getpid()}.partial"
    partial.unlink(missing_ok=True)  # a flush of this process's that failed half-way
    with os.fdopen(os.open(partial, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY, 0o600), "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, target)
    _fsync_dir(target_dir)
    for old in checkpoint_files(directory, host)[KEEP:]:
        old.unlink(missing_ok=True)
    return Checkpoint(target, header.commit, len(data), time.monotonic() - started, time.time())


def _read_verified(path: str, header: BufferHeader) -> bytes | None:
    with open(path, "rb") as file:
        data = file.read(header.file_bytes)
    if len(data) < header.file_bytes or BufferHeader.parse(data) != header:
        return None
    if copying.checksum(memoryview(data)[PAYLOAD_START:], header.payload_length) != header.checksum:
        return None
    return data


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
