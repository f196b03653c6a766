"""How etcd's HTTP/JSON gateway spells requests and answers: the parts of a txn, endpoint lists, and decoders.

The gateway's JSON has keys and values in base64 and 64-bit numbers as
strings, and it omits every field at its default value: a failed txn has no
`succeeded`, a range that matched nothing no `kvs`, a put event no `type`, a
revision 0 no `revision`. The decoders here restore the defaults, so that the
rest of the project never reads the gateway's JSON. An error answer is an HTTP
status >= 400 with {"error", "code", "message"} (`code` the gRPC status code),
or, inside a stream, {"error": {"grpc_code", "message", ...}}: `read_answer`
raises both as `GatewayFailure`. Pure functions: nothing here opens a connection.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from elastic_control_plane.bus.config import ConfigError, check_host

RETRIED_CODES = {4, 14}  # gRPC DeadlineExceeded, Unavailable (no leader, leader changed, request timed out)


class GatewayFailure(Exception):
    """An error answer of the gateway, before the client decides whether to retry it."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def retried(self) -> bool:
        return self.code in RETRIED_CODES or "too many requests" in self.message


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    responses: list[dict[str, Any]]  # one per op run, as the gateway answered, a range's "kvs" as KeyValues


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    kv: KeyValue


@dataclass(frozen=True)
class Member:
    id: int
    name: str  # "" for a member added and not yet started
    peer_urls: list[str]
    client_urls: list[str]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def one_line(text: str) -> str:
    return " ".join(text.split())


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for every key starting with `prefix`: its last byte below 0xff raised by one; b"\\0" (to
    the end of the keyspace) when there is none."""
    for index in reversed(range(len(prefix))):
        if prefix[index] < 0xFF:
            return prefix[:index] + bytes([prefix[index] + 1])
    return b"\0"


def key_range(key: bytes, prefix: bool) -> dict[str, str]:
    if not prefix:
        return {"key": b64(key)}
    return {"key": b64(key or b"\0"), "range_end": b64(prefix_end(key))}


def create_revision_is(key: bytes, revision: int) -> dict[str, Any]:
    """Compare: `key` was created at `revision` (0: the key does not exist)."""
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)}


def mod_revision_is(key: bytes, revision: int) -> dict[str, Any]:
    """Compare: `key` was last written at `revision`."""
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def value_is(key: bytes, value: bytes) -> dict[str, Any]:
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def put_op(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    request = {"key": b64(key), "value": b64(value)}
    if lease:
        request["lease"] = str(lease)
    return {"request_put": request}


def delete_op(key: bytes, *, prefix: bool = False, until: bytes | None = None) -> dict[str, Any]:
    """Delete `key`, every key under it (`prefix`), or every key from it up to `until` (excluded): one operation."""
    if until is not None:
        return {"request_delete_range": {"key": b64(key), "range_end": b64(until)}}
    return {"request_delete_range": key_range(key, prefix)}


def range_op(key: bytes, *, prefix: bool = False) -> dict[str, Any]:
    return {"request_range": key_range(key, prefix)}


def parse_endpoints(text: str) -> list[str]:
    """`host:port,host:port` (an IPv6 host in brackets) as a list; ValueError, one line, for anything else."""
    endpoints = [item.strip() for item in text.split(",")]
    for endpoint in endpoints:
        problem = _endpoint_problem(endpoint)
        if problem:
            raise ValueError(f"etcd endpoints {text!r}: {problem} (want host:port,host:port)")
    return endpoints


def _endpoint_problem(endpoint: str) -> str | None:
    if not endpoint:
        return "an empty endpoint"
    if "://" in endpoint:
        return f"{endpoint!r} has a scheme"
    host, colon, port = endpoint.rpartition(":")
    if not colon or not port.isdigit():
        return f"{endpoint!r} has no port"
    if not 1 <= int(port) <= 65535:
        return f"{endpoint!r}: port {port} is out of range 1-65535"
    if ":" in host and not host.startswith("["):
        return f"{endpoint!r}: an IPv6 host goes in brackets"
    try:
        check_host("host", host)
    except ConfigError as exc:
        return str(exc)
    return None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def decode_kv(kv: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=unb64(kv.get("key", "")),
        value=unb64(kv.get("value", "")),
        create_revision=int(kv.get("create_revision", 0)),
        mod_revision=int(kv.get("mod_revision", 0)),
        version=int(kv.get("version", 0)),
        lease=int(kv.get("lease", 0)),
    )


def header_revision(answer: dict[str, Any]) -> int:
    return int(answer.get("header", {}).get("revision", 0))


def decode_range(answer: dict[str, Any]) -> tuple[list[KeyValue], int, bool]:
    """A range answer as (its kvs, its revision, whether more keys are left past the limit)."""
    return [decode_kv(kv) for kv in answer.get("kvs", [])], header_revision(answer), bool(answer.get("more", False))


def decode_txn(answer: dict[str, Any]) -> TxnResult:
    responses = []
    for response in answer.get("responses", []):
        decoded = dict(response)
        if "response_range" in response:
            decoded["response_range"] = {
                **response["response_range"],
                "kvs": decode_range(response["response_range"])[0],
            }
        responses.append(decoded)
    return TxnResult(bool(answer.get("succeeded", False)), header_revision(answer), responses)


def decode_events(result: dict[str, Any]) -> list[WatchEvent]:
    """The events of one watch answer (none in a progress notification)."""
    return [
        WatchEvent("delete" if event.get("type") == "DELETE" else "put", decode_kv(event.get("kv", {})))
        for event in result.get("events", [])
    ]


def decode_member(member: dict[str, Any]) -> Member:
    return Member(
        id=int(member.get("ID", 0)),
        name=member.get("name", ""),
        peer_urls=list(member.get("peerURLs", [])),
        client_urls=list(member.get("clientURLs", [])),
    )


def decode_status(answer: dict[str, Any]) -> dict[str, int]:
    header = answer.get("header", {})
    return {
        "member_id": int(header.get("member_id", 0)),
        "leader": int(answer.get("leader", 0)),
        "revision": int(header.get("revision", 0)),
        "db_size": int(answer.get("dbSize", 0)),
        "db_size_in_use": int(answer.get("dbSizeInUse", 0)),
    }


def read_answer(status: int, body: bytes) -> dict[str, Any]:
    """The JSON of a gateway answer, unwrapped from a stream's {"result": ...}; GatewayFailure for an error answer
    (HTTP status >= 400 with {"error", "code", "message"}, a stream's {"error": {"grpc_code", ...}}, or no JSON)."""
    try:
        answer = json.loads(body)
    except ValueError:
        # 2 is gRPC's Unknown; 14 (Unavailable) when a proxy in front of a member could not reach it
        code = 14 if status >= 500 else 2
        raise GatewayFailure(code, f"HTTP {status}: {one_line(body[:200].decode(errors='replace'))}") from None
    if not isinstance(answer, dict):
        raise GatewayFailure(2, f"HTTP {status}: not a JSON object")
    if status >= 400:
        raise GatewayFailure(_grpc_code(answer.get("code")), one_line(str(answer.get("message", answer))))
    if isinstance(answer.get("error"), dict):
        error = answer["error"]
        raise GatewayFailure(_grpc_code(error.get("grpc_code")), one_line(str(error.get("message", error))))
    return answer.get("result", answer)


def _grpc_code(value: Any) -> int:
    """An error answer's gRPC code; 2 (Unknown) for anything but an integer (a proxy's own error page)."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else 2
