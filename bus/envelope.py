"""The wire format: one message = msgpack header frame + msgpack body frame + raw frames.

Frame layout, as seen by a ROUTER (the identity frame is added and removed by zmq)::

    [identity] | header | body | raw_0 | raw_1 | ...

    header = msgpack {"v": 1, "type": str, "id": str, "round": int|None,
                      "from": str, "reply": bool}
    body   = msgpack map
    raw_i  = bytes, passed through untouched (tensors, snapshots)

Replies reuse the request's `type` and `id` with `reply: True`. An error reply's
body is `{"error": code, "message": text}`.

Frames are packed by one reused `msgpack.Packer` per thread with a small buffer: `msgpack.packb` allocates a 256 KiB
buffer per call, which in a service (glibc's mmap threshold fixed at 128 KiB by `keep_large_buffers_out_of_the_heap`)
is an mmap and a munmap per frame, 11-17 µs instead of ~1 µs. A packer that grew for a large message is replaced, so
each thread keeps at most about 1 MiB.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import msgpack

VERSION = 1
# The largest legitimate messages are a few MiB: a notifier `since` reply (its history is at most 4 MiB), `hosts` and
# `status` replies of very large clusters, a `round` event (at most 1 MiB). Larger ones are refused with `too_large`.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# A packer's first buffer: more than a heartbeat or a join answer needs, far below the mmap threshold. It grows (msgpack
# doubles it) for a larger frame and keeps that size.
PACKER_BUFFER_BYTES = 4 * 1024
# A packer that packed a frame larger than this holds a buffer of up to twice that (1 MiB): a fresh one replaces it.
REPLACE_PACKER_ABOVE_BYTES = 512 * 1024


class WireError(ValueError):
    """Input that is not a valid message; `code` is the error code sent back."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Message:
    type: str
    body: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    round: int | None = None
    sender: str = ""
    reply: bool = False
    raw: tuple[bytes, ...] = ()

    @property
    def error(self) -> str | None:
        return self.body.get("error") if self.reply else None


def _new_packer() -> msgpack.Packer:
    return msgpack.Packer(use_bin_type=True, buf_size=PACKER_BUFFER_BYTES)


class _ThreadPacker(threading.local):
    """The calling thread's packer: a Packer is not thread-safe, and clients and services encode from many threads."""

    def __init__(self) -> None:
        self.packer = _new_packer()


_thread_packer = _ThreadPacker()


def _pack(value: Any) -> bytes:
    """`msgpack.packb(value, use_bin_type=True)`, byte for byte, with this thread's packer."""
    frame: bytes = _thread_packer.packer.pack(value)
    if len(frame) > REPLACE_PACKER_ABOVE_BYTES:
        _thread_packer.packer = _new_packer()  # the grown buffer goes with the old packer
    return frame


def encode(msg: Message) -> list[bytes]:
    header = {
        "v": VERSION,
        "type": msg.type,
        "id": msg.id,
        "round": msg.round,
        "from": msg.sender,
        "reply": msg.reply,
    }
    return [
        _pack(header),
        _pack(msg.body),
        *msg.raw,
    ]


def _unpack_map(frame: bytes, what: str) -> dict[str, Any]:
    try:
        value = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError("malformed", f"{what} frame is not msgpack: {exc}") from None
    if not isinstance(value, dict):
        raise WireError("malformed", f"{what} frame is not a map")
    return value


def decode(frames: list[bytes], max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Parse frames (without routing identity) into a Message or raise WireError."""
    size = sum(len(f) for f in frames)
    if size > max_bytes:
        raise WireError("too_large", f"message of {size} bytes exceeds {max_bytes}")
    if len(frames) < 2:
        raise WireError("malformed", f"expected header and body frames, got {len(frames)} frame(s)")
    header = _unpack_map(frames[0], "header")
    version = header.get("v")
    if version != VERSION:
        raise WireError("version", f"unsupported wire version {version!r}, this side speaks {VERSION}")
    msg_type, msg_id = header.get("type"), header.get("id", "")
    if not isinstance(msg_type, str) or not msg_type:
        raise WireError("malformed", "header has no message type")
    if not isinstance(msg_id, str):
        raise WireError("malformed", "header id is not a string")
    round_ = header.get("round")
    if round_ is not None and not isinstance(round_, int):
        raise WireError("malformed", "header round is not an integer")
    sender = header.get("from", "")
    if not isinstance(sender, str):
        raise WireError("malformed", "header from is not a string")
    body = _unpack_map(frames[1], "body")
    return Message(
        type=msg_type,
        body=body,
        id=msg_id,
        round=round_,
        sender=sender,
        reply=bool(header.get("reply", False)),
        raw=tuple(frames[2:]),
    )


def reply_to(request: Message, body: dict[str, Any], sender: str, raw: tuple[bytes, ...] = ()) -> Message:
    return Message(type=request.type, body=body, id=request.id, round=request.round, sender=sender, reply=True, raw=raw)


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": code, "message": message}
