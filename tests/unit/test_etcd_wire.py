"""etcd's gateway spelling: txn parts, endpoint lists, and answers decoded with the fields the gateway omits."""

import base64

import pytest

from elastic_control_plane.replication.etcd import EtcdClient, TxnTooLarge
from elastic_control_plane.replication.etcd_wire import (
    GatewayFailure,
    KeyValue,
    create_revision_is,
    decode_events,
    decode_kv,
    decode_member,
    decode_range,
    decode_status,
    decode_txn,
    delete_op,
    parse_endpoints,
    prefix_end,
    put_op,
    range_op,
    read_answer,
    split_endpoint,
    value_is,
)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_compares_name_the_key_in_base64_and_numbers_as_strings():
    assert create_revision_is(b"job/leader", 0) == {
        "key": b64(b"job/leader"),
        "target": "CREATE",
        "result": "EQUAL",
        "create_revision": "0",
    }
    assert value_is(b"k", b"\x00\xff") == {
        "key": b64(b"k"),
        "target": "VALUE",
        "result": "EQUAL",
        "value": b64(b"\x00\xff"),
    }


def test_ops_carry_a_lease_and_a_range_end_only_when_asked():
    assert put_op(b"k", b"v") == {"request_put": {"key": b64(b"k"), "value": b64(b"v")}}
    assert put_op(b"k", b"", lease=7587)["request_put"] == {"key": b64(b"k"), "value": "", "lease": "7587"}
    assert delete_op(b"k") == {"request_delete_range": {"key": b64(b"k")}}
    assert delete_op(b"jobs/", prefix=True) == {
        "request_delete_range": {"key": b64(b"jobs/"), "range_end": b64(b"jobs0")}
    }
    assert range_op(b"a", prefix=True) == {"request_range": {"key": b64(b"a"), "range_end": b64(b"b")}}
    assert range_op(b"", prefix=True) == {"request_range": {"key": b64(b"\0"), "range_end": b64(b"\0")}}


@pytest.mark.parametrize(
    ("prefix", "end"),
    [
        (b"a", b"b"),
        (b"jobs/", b"jobs0"),
        (b"a\xff", b"b"),
        (b"a\xfe\xff", b"a\xff"),
        (b"\xff\xff", b"\0"),
        (b"", b"\0"),
    ],
)
def test_prefix_end_is_the_first_key_after_every_key_with_the_prefix(prefix, end):
    assert prefix_end(prefix) == end


@pytest.mark.parametrize(
    ("text", "endpoints"),
    [
        ("127.0.0.1:2379", ["127.0.0.1:2379"]),
        ("127.0.0.1:2379,127.0.0.2:2379", ["127.0.0.1:2379", "127.0.0.2:2379"]),
        (" etcd-0.etcd:2379 , etcd-1.etcd:2379 ", ["etcd-0.etcd:2379", "etcd-1.etcd:2379"]),
        ("[::1]:2379,[fd00::2]:1", ["[::1]:2379", "[fd00::2]:1"]),
        ("localhost:65535", ["localhost:65535"]),
    ],
)
def test_endpoint_lists_that_parse(text, endpoints):
    assert parse_endpoints(text) == endpoints


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "an empty endpoint"),
        ("127.0.0.1:2379,", "an empty endpoint"),
        ("127.0.0.1", "has no port"),
        ("127.0.0.1:", "has no port"),
        ("127.0.0.1:http", "has no port"),
        ("127.0.0.1:0", "out of range"),
        ("127.0.0.1:65536", "out of range"),
        (":2379", "no host"),
        ("::1:2379", "in brackets"),
        ("[::g]:2379", "not a host name or an IP address"),
        ("300.1.1.1:2379", "not an IP address"),
        ("bad host:2379", "not a host name"),
        ("http://127.0.0.1:2379", "has a scheme"),
    ],
)
def test_malformed_endpoint_lists_are_refused_in_one_line_naming_the_list(text, problem):
    with pytest.raises(ValueError) as refused:
        parse_endpoints(text)
    message = str(refused.value)
    assert problem in message and repr(text) in message and "\n" not in message


def test_split_endpoint_drops_the_brackets_of_an_ipv6_host():
    assert split_endpoint("[::1]:2379") == ("::1", 2379)
    assert split_endpoint("127.0.0.2:23790") == ("127.0.0.2", 23790)


def test_a_key_value_with_every_default_omitted():
    assert decode_kv({"key": b64(b"k")}) == KeyValue(b"k", b"", 0, 0, 0, 0)
    full = {"key": b64(b"k"), "value": b64(b"v"), "create_revision": "2", "mod_revision": "5", "version": "3"}
    assert decode_kv({**full, "lease": "7587"}) == KeyValue(b"k", b"v", 2, 5, 3, 7587)


def test_a_range_that_matched_nothing_has_no_kvs_and_a_revision_0_store_no_revision():
    assert decode_range({"header": {"cluster_id": "1", "member_id": "2", "raft_term": "2"}}) == ([], 0, False)
    answer = {"header": {"revision": "9"}, "kvs": [{"key": b64(b"a"), "mod_revision": "9"}], "more": True, "count": "4"}
    assert decode_range(answer) == ([KeyValue(b"a", b"", 0, 9, 0, 0)], 9, True)


def test_a_failed_txn_has_no_succeeded_field():
    answer = {
        "header": {"revision": "2"},
        "responses": [
            {"response_range": {"header": {"revision": "2"}, "kvs": [{"key": b64(b"a"), "value": b64(b"1")}]}}
        ],
    }
    result = decode_txn(answer)
    assert not result.succeeded and result.revision == 2
    assert result.responses[0]["response_range"]["kvs"] == [KeyValue(b"a", b"1", 0, 0, 0, 0)]
    assert decode_txn({"header": {"revision": "3"}, "succeeded": True, "responses": [{"response_put": {}}]}).succeeded
    assert decode_txn({"header": {}, "responses": [{"response_range": {"header": {}}}]}).responses == [
        {"response_range": {"header": {}, "kvs": []}}
    ]


def test_a_put_event_has_no_type_and_a_delete_event_only_a_key_and_a_revision():
    result = {
        "header": {"revision": "4"},
        "events": [
            {"kv": {"key": b64(b"a"), "create_revision": "4", "mod_revision": "4", "version": "1", "value": b64(b"1")}},
            {"type": "DELETE", "kv": {"key": b64(b"b"), "mod_revision": "4"}},
        ],
    }
    put, delete = decode_events(result)
    assert (put.kind, put.kv) == ("put", KeyValue(b"a", b"1", 4, 4, 1, 0))
    assert (delete.kind, delete.kv) == ("delete", KeyValue(b"b", b"", 0, 4, 0, 0))
    assert decode_events({"header": {"revision": "4"}}) == []  # a progress notification


def test_a_member_added_and_not_started_has_no_name_and_no_client_urls():
    member = decode_member({"ID": "13939164800299956139", "peerURLs": ["http://127.0.0.9:2380"]})
    assert (member.id, member.name, member.peer_urls, member.client_urls) == (
        13939164800299956139,
        "",
        ["http://127.0.0.9:2380"],
        [],
    )


def test_a_status_answer_in_the_gateways_camel_case():
    answer = {
        "header": {"member_id": "3319814642761637952", "revision": "2", "raft_term": "2"},
        "version": "3.4.23",
        "dbSize": "20480",
        "dbSizeInUse": "16384",
        "leader": "3319814642761637952",
    }
    assert decode_status(answer) == {
        "member_id": 3319814642761637952,
        "leader": 3319814642761637952,
        "revision": 2,
        "db_size": 20480,
        "db_size_in_use": 16384,
    }
    assert decode_status({"header": {"member_id": "5"}})["leader"] == 0  # no leader: the field is left out


def test_answers_unwrap_a_streams_result():
    assert read_answer(200, b'{"result": {"header": {}, "ID": "1"}}') == {"header": {}, "ID": "1"}
    assert read_answer(200, b'{"header": {"revision": "2"}}') == {"header": {"revision": "2"}}


@pytest.mark.parametrize(
    ("status", "body", "code", "retried"),
    [
        (
            503,
            b'{"error": "etcdserver: leader changed", "message": "etcdserver: leader changed", "code": 14}',
            14,
            True,
        ),
        (
            503,
            b'{"error": "etcdserver: request timed out", "message": "etcdserver: request timed out", "code": 14}',
            14,
            True,
        ),
        (504, b'{"error": "context deadline exceeded", "message": "context deadline exceeded", "code": 4}', 4, True),
        (429, b'{"error": "x", "message": "etcdserver: too many requests", "code": 8}', 8, True),
        (429, b'{"message": "grpc: received message larger than max (3000010 vs. 2097152)", "code": 8}', 8, False),
        (400, b'{"message": "etcdserver: request is too large", "code": 3}', 3, False),
        (400, b'{"message": "etcdserver: too many operations in txn request", "code": 3}', 3, False),
        (404, b'{"message": "etcdserver: requested lease not found", "code": 5}', 5, False),
        (404, b"Not Found\n", 2, False),
        (502, b"<html>bad gateway</html>", 14, True),
        (200, b'{"error": {"grpc_code": 14, "http_code": 503, "message": "etcdserver: no leader"}}', 14, True),
    ],
)
def test_error_answers_are_failures_retried_only_when_they_mean_not_now(status, body, code, retried):
    with pytest.raises(GatewayFailure) as failure:
        read_answer(status, body)
    assert (failure.value.code, failure.value.retried) == (code, retried)
    assert "\n" not in failure.value.message


def test_a_txn_over_etcds_limit_of_operations_is_a_bug_never_sent() -> None:
    client = EtcdClient(["127.0.0.1:9"])  # nothing listens: a txn that were sent would fail otherwise
    try:
        with pytest.raises(TxnTooLarge, match="a txn of 129 success operations: etcd takes 128 at most"):
            client.txn([], [put_op(b"k%d" % i, b"v") for i in range(129)])
    finally:
        client.close()


def test_a_range_delete_names_its_end() -> None:
    op = delete_op(b"p/events/0000000000000001", until=b"p/events/0000000000000200")["request_delete_range"]
    assert base64.b64decode(op["key"]) == b"p/events/0000000000000001"
    assert base64.b64decode(op["range_end"]) == b"p/events/0000000000000200"
