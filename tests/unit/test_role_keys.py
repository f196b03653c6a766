"""A process is handed its role's keys only (issue 58: Slurm gave every agent the whole job key directory, the server's
secret and the operator's keypair among it): the server's public key and the role's keypair, the secret 0600."""

from __future__ import annotations

import stat
from pathlib import Path

from elastic_control_plane.bus.roles import AGENT, OPERATOR
from elastic_control_plane.bus.sockets import Security, generate_keys, role_keys


def test_an_agents_share_holds_its_keypair_and_the_servers_public_key_only(tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys")
    share = role_keys(tmp_path / "keys", AGENT, tmp_path / "agent-keys")
    assert sorted(p.name for p in share.iterdir()) == ["agent.key", "agent.key_secret", "server.key"]
    assert stat.S_IMODE(share.stat().st_mode) == 0o700
    assert stat.S_IMODE((share / "agent.key_secret").stat().st_mode) == 0o600
    security = Security(keys_dir=share, role=AGENT)
    assert security.client_keypair()[0] == (tmp_path / "keys" / "agent.key").read_bytes().split(b'"')[1]
    assert security.server_public_key()


def test_an_operators_share_and_a_second_call_rewrite_it_whole(tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys")
    share = role_keys(tmp_path / "keys", OPERATOR, tmp_path / "operator-keys")
    (share / "client.key_secret").write_text("stale")
    role_keys(tmp_path / "keys", OPERATOR, share)
    assert sorted(p.name for p in share.iterdir()) == ["client.key", "client.key_secret", "server.key"]
    assert (share / "client.key_secret").read_bytes() == (tmp_path / "keys" / "client.key_secret").read_bytes()
