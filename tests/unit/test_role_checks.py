"""Role checks fail closed (bus/roles.py, issue 58): a key of no role, or a directory missing a role's key, gets only
what every role may call; the one key of a directory made before roles is every role, as it was."""

from __future__ import annotations

from pathlib import Path

import zmq.auth

from elastic_control_plane.bus.roles import AGENT, ANY_ROLE, AUTHORIZED_DIR, OPERATOR, SERVICE, CallerRoles
from elastic_control_plane.bus.sockets import generate_keys

SERVICES_ONLY = frozenset({SERVICE})


def public(path: Path) -> str:
    return zmq.auth.load_certificate(path)[0].decode()


def test_each_role_key_calls_its_own_handlers_only(tmp_path: Path) -> None:
    generate_keys(tmp_path)
    roles = CallerRoles(tmp_path)
    service, agent, operator = (public(tmp_path / f"{name}.key") for name in ("service", "agent", "client"))
    assert roles.allows(service, SERVICES_ONLY)
    assert not roles.allows(agent, SERVICES_ONLY) and not roles.allows(operator, SERVICES_ONLY)
    assert roles.allows(agent, ANY_ROLE) and roles.allows(None, SERVICES_ONLY)  # open handlers; owner-only ipc


def test_a_key_added_by_hand_has_no_role_and_calls_only_open_handlers(tmp_path: Path) -> None:
    generate_keys(tmp_path)
    zmq.auth.create_certificates(tmp_path / AUTHORIZED_DIR, "extra")
    roles = CallerRoles(tmp_path)
    extra = public(tmp_path / AUTHORIZED_DIR / "extra.key")
    assert roles.role_of(extra) is None
    assert not roles.allows(extra, frozenset({SERVICE, AGENT, OPERATOR}))
    assert roles.allows(extra, ANY_ROLE)


def test_a_directory_missing_the_service_key_does_not_open_service_handlers_to_agents(tmp_path: Path) -> None:
    """Before: one role key missing turned every check off (an agent's key could start rounds)."""
    generate_keys(tmp_path)
    (tmp_path / AUTHORIZED_DIR / "service.key").unlink()
    roles = CallerRoles(tmp_path)
    agent = public(tmp_path / "agent.key")
    assert not roles.single_key
    assert not roles.allows(agent, SERVICES_ONLY)
    assert roles.allows(agent, frozenset({AGENT}))


def test_the_one_key_of_a_directory_made_before_roles_is_every_role(tmp_path: Path) -> None:
    generate_keys(tmp_path)
    for name in ("agent", "service"):
        (tmp_path / AUTHORIZED_DIR / f"{name}.key").unlink()
    roles = CallerRoles(tmp_path)
    assert roles.single_key
    assert roles.allows(public(tmp_path / "client.key"), SERVICES_ONLY)
    assert not roles.allows(public(tmp_path / "agent.key"), SERVICES_ONLY), "an unauthorised key has no role"
