"""A process is handed its role's keys only (issue 58: Slurm gave every agent the whole job key directory, the server's
secret and the operator's keypair among it): the server's public key and the role's keypair, the secret 0600."""

from __future__ import annotations

import stat
import subprocess
import sys
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


def test_elasticctl_keys_share_writes_a_roles_share_and_refuses_a_missing_directory(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "keys"]
    subprocess.run([*command, "generate", str(tmp_path / "keys")], check=True, capture_output=True, timeout=60)
    shared = subprocess.run(
        [*command, "share", str(tmp_path / "keys"), str(tmp_path / "agent"), "--role", "agent"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shared.returncode == 0, shared.stderr
    assert sorted(p.name for p in (tmp_path / "agent").iterdir()) == ["agent.key", "agent.key_secret", "server.key"]
    missing = subprocess.run(
        [*command, "share", str(tmp_path / "nowhere"), str(tmp_path / "x"), "--role", "agent"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
