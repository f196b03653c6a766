"""The wire format: encode/decode round trips with raw frames, the per-thread packer, precise decode errors."""

from __future__ import annotations

import threading

import msgpack
import pytest

from elastic_control_plane.bus import envelope
from elastic_control_plane.bus.envelope import VERSION, Message, WireError, decode, encode, error_body, reply_to


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


# -- the per-thread packer -----------------------------------------------------------------------


def join_answer(round_: int) -> dict:
    answers = [[i, {"rank": i, "local_rank": i % 8, "size": 32768, "host": f"host-{i}"}] for i in range(8)]
    return {"round": round_, "prefix": f"round/{round_}/", "hosts_timestamp": 1.0, "answers": answers}


def packb_frames(msg: Message) -> list[bytes]:
    """What encode produced before it reused a packer: the wire format it must keep byte for byte."""
    header = {"v": VERSION, "type": msg.type, "id": msg.id, "round": msg.round, "from": msg.sender, "reply": msg.reply}
    return [pack(header), pack(msg.body), *msg.raw]


@pytest.mark.parametrize(
    "body",
    [{}, join_answer(3), {"blob": b"\x00" * 70_000, "text": "é" * 40_000, "n": -(2**63), "f": 0.1, "t": True}],
    ids=["empty", "join_answer", "bin_and_unicode"],
)
def test_encode_gives_the_bytes_of_msgpack_packb(body):
    msg = Message(type="join", body=body, id="7", round=3, sender="rendezvous", reply=True)
    assert encode(msg) == packb_frames(msg)


def test_a_large_message_replaces_the_grown_packer_and_small_ones_after_it_are_right():
    small = Message(type="heartbeat", body={"host": "h1", "seq": 1}, id="1", sender="agent/h1")
    encode(small)
    packer_before = envelope._thread_packer.packer
    large = Message(type="hosts", body={"hosts": ["h" * 100] * 20_000}, id="2", sender="discovery", reply=True)
    frames = encode(large)
    assert len(frames[1]) > envelope.REPLACE_PACKER_ABOVE_BYTES
    assert frames == packb_frames(large)
    packer_after = envelope._thread_packer.packer
    assert packer_after is not packer_before
    for seq in range(3):
        msg = Message(type="heartbeat", body={"host": "h1", "seq": seq}, id=str(seq), sender="agent/h1")
        assert encode(msg) == packb_frames(msg)
    assert envelope._thread_packer.packer is packer_after


def test_a_message_that_cannot_be_packed_leaves_the_packer_usable():
    with pytest.raises(TypeError):
        encode(Message(type="t", body={"ok": [1, 2], "bad": object()}))
    msg = Message(type="t", body={"ok": [1, 2]})
    assert encode(msg) == packb_frames(msg)


def test_threads_encoding_at_once_each_get_their_own_frames():
    threads, rounds_per_thread = 4, 2000
    start = threading.Barrier(threads)
    wrong: list[tuple[int, int]] = []
    packers: dict[int, msgpack.Packer] = {}  # kept alive, so that no two can be the same object

    def encode_many(thread: int) -> None:
        start.wait()
        for n in range(rounds_per_thread):
            msg = Message(type="join", body=join_answer(thread * rounds_per_thread + n), id=f"{thread}-{n}", reply=True)
            if encode(msg) != packb_frames(msg):
                wrong.append((thread, n))
        packers[thread] = envelope._thread_packer.packer

    workers = [threading.Thread(target=encode_many, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert wrong == []
    assert len({id(packer) for packer in packers.values()}) == threads


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
