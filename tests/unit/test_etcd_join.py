"""replication/etcd_join.py's pure parts: a member's flags become etcd's config file (TLS in its sections, durations
in nanoseconds, the gateway a config file would otherwise lose), and bad input is one line and exit 2."""

from __future__ import annotations

import pytest

from elastic_control_plane.replication.etcd_join import config_of, main, nanoseconds, parse_flags


def test_the_flags_become_the_config_file() -> None:
    flags = parse_flags(
        [
            "--name=m0",
            "--heartbeat-interval=100",
            "--experimental-watch-progress-notify-interval=1s",
            "--client-cert-auth",
            "--cert-file=/tls/server.crt",
            "--peer-trusted-ca-file=/tls/ca.crt",
            "--auto-compaction-retention=10m",
        ]
    )
    assert config_of(flags) == {
        "enable-grpc-gateway": True,
        "name": "m0",
        "heartbeat-interval": 100,
        "experimental-watch-progress-notify-interval": 10**9,
        "client-transport-security": {"client-cert-auth": True, "cert-file": "/tls/server.crt"},
        "peer-transport-security": {"trusted-ca-file": "/tls/ca.crt"},
        "auto-compaction-retention": "10m",
    }
    assert nanoseconds("500ms") == 500 * 10**6 and nanoseconds("2m") == 120 * 10**9


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["/c.json", "--others", "h:1", "--", "name=m0"], "'name=m0' is not an etcd flag"),
        (["/c.json", "--", "--name=m0"], "expected --others"),
        (
            ["/c.json", "--others", "h:1", "--", "--name=m0", "--data-dir=/d"],
            "--initial-advertise-peer-urls is missing",
        ),
        (["/c.json", "--others", "h:1"], "usage"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
