"""The wire format: encode/decode round trip with raw frames, and decode errors with precise codes."""

from __future__ import annotations

import msgpack
import pytest

from bus.envelope import VERSION, Message, WireError, decode, encode, error_body, reply_to


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


_MISSING = object()


def header(**overrides) -> bytes:
    base = {"v": VERSION, "type": "ping", "id": "1", "round": None, "from": "test", "reply": False}
    base.update(overrides)
    return pack({k: v for k, v in base.items() if v is not _MISSING})


def wire_error(frames, **kw) -> WireError:
    with pytest.raises(WireError) as info:
        decode(frames, **kw)
    return info.value


# -- round trip ----------------------------------------------------------------------------------


def test_round_trip_keeps_every_field_and_raw_frames_untouched():
    raw = (b"\x00\x01\x02tensor bytes", b"", b"\xff" * 1000)
    msg = Message(
        type="kv_set",
        body={"key": "round/1/store", "n": 3, "nested": {"list": [1, 2.5, "x", None, True]}, "blob": b"\x00bin"},
        id="req-42",
        round=7,
        sender="agent/host-1",
        raw=raw,
    )
    frames = encode(msg)
    assert len(frames) == 2 + len(raw)
    assert frames[2:] == list(raw)
    assert all(a is b for a, b in zip(frames[2:], raw, strict=True))  # not re-encoded
    decoded = decode(frames)
    assert decoded == msg
    assert decoded.raw == raw


def test_round_trip_without_raw_frames():
    msg = Message(type="status", body={}, id="x", sender="elasticctl")
    frames = encode(msg)
    assert len(frames) == 2
    assert decode(frames) == msg


def test_round_trip_of_a_reply_with_error():
    request = Message(type="submit", body={"spec": {}}, id="9", round=2, sender="ctl")
    reply = reply_to(request, error_body("bad_spec", "min_np > max_np"), sender="registry")
    decoded = decode(encode(reply))
    assert decoded.reply is True
    assert (decoded.type, decoded.id, decoded.round, decoded.sender) == ("submit", "9", 2, "registry")
    assert decoded.error == "bad_spec"
    assert decoded.body["message"] == "min_np > max_np"


def test_request_has_no_error_even_with_an_error_key_in_body():
    assert decode(encode(Message(type="t", body={"error": "x"}))).error is None


def test_header_frame_carries_version_and_fields():
    frames = encode(Message(type="t", body={"a": 1}, id="i", round=3, sender="s", reply=True))
    assert msgpack.unpackb(frames[0]) == {"v": VERSION, "type": "t", "id": "i", "round": 3, "from": "s", "reply": True}
    assert msgpack.unpackb(frames[1]) == {"a": 1}


def test_decode_minimal_header_defaults():
    msg = decode([pack({"v": VERSION, "type": "ping"}), pack({})])
    assert (msg.id, msg.round, msg.sender, msg.reply, msg.raw) == ("", None, "", False, ())


def test_message_exactly_at_max_bytes_is_accepted():
    frames = encode(Message(type="t", body={"k": "v"}, raw=(b"x" * 10,)))
    size = sum(len(f) for f in frames)
    assert decode(frames, max_bytes=size).raw == (b"x" * 10,)


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1",
        b"",
        b"\x82",
        b"\x81\xa1a",
        b"\x92\x01\x02\x03",
        b"\xa2\xff\xfe",
        b"\x81\x01\x02",
        b"\x81\x91\x01\x01",
        b"\xdf\xff\xff\xff\xff",
        b"\x91" * 100_000,
    ],
    ids=[
        "reserved_byte",
        "empty",
        "truncated_map",
        "truncated_value",
        "extra_data",
        "bad_utf8",
        "int_key",
        "list_key",
        "huge_declared_map",
        "deeply_nested",
    ],
)
def test_header_not_msgpack_is_malformed(frame):
    assert wire_error([frame, pack({})]).code == "malformed"


@pytest.mark.parametrize("frame", [b"\xc1", b"", b"\x82", b"not msgpack at all \xc1"])
def test_body_not_msgpack_is_malformed(frame):
    assert wire_error([header(), frame]).code == "malformed"


@pytest.mark.parametrize("value", [[1, 2], "text", 3, None, b"bytes"], ids=["list", "str", "int", "nil", "bin"])
def test_body_not_a_map_is_malformed(value):
    err = wire_error([header(), pack(value)])
    assert err.code == "malformed"
    assert "body" in err.message


@pytest.mark.parametrize("value", [[VERSION, "ping"], "v1", 1])
def test_header_not_a_map_is_malformed(value):
    err = wire_error([pack(value), pack({})])
    assert err.code == "malformed"
    assert "header" in err.message


@pytest.mark.parametrize(
    "version", [0, 2, VERSION + 1, "1", None, _MISSING], ids=["0", "2", "next", "str", "nil", "missing"]
)
def test_wrong_version_is_version(version):
    assert wire_error([header(v=version), pack({})]).code == "version"


def test_wrong_version_is_detected_before_the_body():
    assert wire_error([header(v=99), b"\xc1"]).code == "version"


@pytest.mark.parametrize("msg_type", [_MISSING, "", None, 5, b"ping"], ids=["missing", "empty", "nil", "int", "bin"])
def test_missing_or_bad_type_is_malformed(msg_type):
    assert wire_error([header(type=msg_type), pack({})]).code == "malformed"


@pytest.mark.parametrize(
    "field_overrides",
    [{"id": 5}, {"round": "3"}, {"round": 1.5}, {"from": 7}],
    ids=["id_not_str", "round_str", "round_float", "from_not_str"],
)
def test_bad_header_fields_are_malformed(field_overrides):
    assert wire_error([header(**field_overrides), pack({})]).code == "malformed"


def test_oversized_message_is_too_large():
    frames = encode(Message(type="t", body={}, raw=(b"x" * 100,)))
    err = wire_error(frames, max_bytes=50)
    assert err.code == "too_large"


def test_size_limit_counts_raw_frames_and_wins_over_other_errors():
    assert wire_error([b"\xc1", b"\xc1", b"x" * 64], max_bytes=16).code == "too_large"


def test_single_frame_is_malformed():
    assert wire_error([header()]).code == "malformed"


def test_no_frames_is_malformed():
    assert wire_error([]).code == "malformed"


def test_wire_error_is_a_value_error_with_code_and_message():
    err = wire_error([header()])
    assert isinstance(err, ValueError)
    assert err.message == str(err)
