"""The snapshot file layout, without torch: buffer headers, buffer files, and reading which commit a buffer holds.

A host's snapshot is two buffer files in shared memory (`<prefix>.0`,
`<prefix>.1`), created by the agent; a durable checkpoint is one file with
the same layout. Each file is a header page, then the payload: the tensors'
raw bytes (64-byte aligned, in the order of the tree's tensor list), then the
metadata (the tree's skeleton and each tensor's dtype, shape, offset, size and device kind,
cloudpickled: no tensor data is pickled).

The header names the job, the commit counter, the payload's length and a
checksum over every payload byte (`snapshot.copying`), and carries a CRC of
its own fields; a header that is zeroed (a buffer being written) or whose CRC
does not match marks no complete snapshot. Commit 0 is the state the job
started from (written at the first sync). The agent reads headers to report
its host's commit; writing and restoring is `snapshot.store`.
"""

from __future__ import annotations

import os
import stat
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"ELSNAP01"
PAYLOAD_START = 4096
ALIGN = 64
FIELDS = struct.Struct("<8s32sQQQQId")
HEADER = struct.Struct(f"<{FIELDS.size}sI")
HEADER_BYTES = HEADER.size


@dataclass(frozen=True)
class BufferHeader:
    job: str
    commit: int
    payload_length: int
    meta_offset: int
    meta_length: int
    checksum: int
    written_at: float

    def pack(self) -> bytes:
        fields = FIELDS.pack(
            MAGIC,
            self.job.encode()[:32],
            self.commit,
            self.payload_length,
            self.meta_offset,
            self.meta_length,
            self.checksum,
            self.written_at,
        )
        return HEADER.pack(fields, zlib.crc32(fields))

    @classmethod
    def parse(cls, raw: bytes) -> BufferHeader | None:
        """The header of a complete buffer, or None (never written, being written, or damaged)."""
        if len(raw) < HEADER.size:
            return None
        fields, crc = HEADER.unpack_from(raw)
        if zlib.crc32(fields) != crc:
            return None
        magic, job, commit, length, meta_offset, meta_length, checksum, written_at = FIELDS.unpack(fields)
        if magic != MAGIC or meta_offset + meta_length != length:
            return None
        return cls(
            job.rstrip(b"\0").decode(errors="replace"), commit, length, meta_offset, meta_length, checksum, written_at
        )

    @property
    def file_bytes(self) -> int:
        return PAYLOAD_START + self.payload_length


INVALID = bytes(HEADER_BYTES)


def buffer_paths(prefix: str) -> tuple[str, str]:
    return f"{prefix}.0", f"{prefix}.1"


# A file the agent makes in shared memory is new, its own and no link: a name someone else made first (a planted file,
# or a symlink to one of the agent's user's files) makes the open fail instead of being followed or truncated.
CREATE_PRIVATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR


def create(prefix: str) -> None:
    """The agent's part: two empty buffer files, new, readable and writable by this user only (the last job's, if
    any, removed first). OSError when a name is taken by someone else's file."""
    remove(prefix)
    for path in buffer_paths(prefix):
        fd = os.open(path, CREATE_PRIVATE, 0o600)
        try:
            os.ftruncate(fd, PAYLOAD_START)
        finally:
            os.close(fd)


def remove(prefix: str) -> None:
    for path in buffer_paths(prefix):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def read_header(path: str | Path) -> BufferHeader | None:
    """The header of the regular file at `path`, or None: a symlink is not followed, nor a FIFO waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return BufferHeader.parse(os.read(fd, HEADER.size))
    except OSError:
        return None
    finally:
        os.close(fd)


def newest_header(paths: Sequence[str | Path]) -> BufferHeader | None:
    """The newest complete buffer's header (its checksum is not verified: for reporting, not restoring)."""
    headers = [h for h in map(read_header, paths) if h is not None]
    return max(headers, key=lambda h: (h.commit, h.written_at), default=None)
