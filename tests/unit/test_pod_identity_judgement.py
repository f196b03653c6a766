"""The verdict on a TokenReview's status (services/discovery/pod_identity.py `judge`): the pod named as the host, of
the agents' service account, for the audience, authenticated; anything short of that, or shaped otherwise than the
API answers, proves nothing."""

from __future__ import annotations

from typing import Any

import pytest

from elastic_control_plane.services.discovery.pod_identity import (
    NODE_NAME,
    POD_NAME,
    Identity,
    NotThisHost,
    judge,
    service_account_user,
)

USER = service_account_user("ml", "elastic-agent")


def status(**changes: Any) -> dict[str, Any]:
    extra = {POD_NAME: ["agent-0"], NODE_NAME: ["node-a"]}
    return {"authenticated": True, "audiences": ["aud"], "user": {"username": USER, "extra": extra}, **changes}


def test_the_pods_own_token_proves_its_name_and_node() -> None:
    assert judge(status(), "agent-0", "aud", USER) == Identity("agent-0", "node-a")
    no_node = status(user={"username": USER, "extra": {POD_NAME: ["agent-0"]}})
    assert judge(no_node, "agent-0", "aud", USER) == Identity("agent-0", None), "older APIs name no node"


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (status(authenticated=False, error="token expired"), "token expired"),
        ({"user": {}}, "unknown or expired"),
        (status(authenticated="true"), "does not authenticate"),
        (status(audiences=["other"]), "audience"),
        (status(audiences=None), "audience"),
        (status(user={"username": service_account_user("ml", "default"), "extra": {POD_NAME: ["agent-0"]}}), "default"),
        (status(user="system:anonymous"), "service account"),
        (status(user={"username": USER}), "no pod"),
        (status(user={"username": USER, "extra": {POD_NAME: "agent-0"}}), "no pod"),
        (status(user={"username": USER, "extra": {POD_NAME: ["agent-1"]}}), "pod 'agent-1'"),
    ],
)
def test_anything_else_proves_nothing(answer: dict[str, Any], says: str) -> None:
    with pytest.raises(NotThisHost, match=says):
        judge(answer, "agent-0", "aud", USER)
