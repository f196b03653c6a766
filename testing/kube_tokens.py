"""The service-account tokens of testing/kube_apiserver.py's API server, and what a TokenReview of one answers, as
the real API does for a bound (projected) token.

`issue(pod, audience, account, node)` makes one, as the kubelet asks for a pod's projected token. A review that asks
for its audience (none asked: the API's own, API_AUDIENCE) authenticates it as the user
system:serviceaccount:NS:ACCOUNT, with the pod's name and its node's in `extra`. Any other token, one for another
audience, one `expire`d, or one whose pod was deleted (`pod_deleted`): authenticated false, with the API's error.
"""

from __future__ import annotations

import json
import secrets
import threading
from dataclasses import dataclass
from typing import Any

TOKEN_REVIEWS_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
API_AUDIENCE = "https://kubernetes.default.svc.cluster.local"  # the API's own audience (its --api-audiences)
POD_NAME, NODE_NAME = "authentication.kubernetes.io/pod-name", "authentication.kubernetes.io/node-name"
FORBIDDEN_REVIEW = (
    'tokenreviews.authentication.k8s.io is forbidden: User "system:serviceaccount:{namespace}:discovery" cannot '
    'create resource "tokenreviews" in API group "authentication.k8s.io" at the cluster scope'
)


@dataclass
class _Token:
    pod: str
    audience: str
    account: str
    node: str | None
    valid: bool = True


class Tokens:
    """The tokens issued in `namespace`."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._issued: dict[str, _Token] = {}
        self._lock = threading.Lock()

    def issue(self, pod: str, audience: str, account: str = "default", node: str | None = None) -> str:
        """A projected token of service account `account`, bound to `pod` (on `node`), for `audience`."""
        token = secrets.token_urlsafe(48)
        with self._lock:
            self._issued[token] = _Token(pod, audience, account, node)
        return token

    def expire(self, token: str) -> None:
        with self._lock:
            self._issued[token].valid = False

    def pod_deleted(self, pod: str) -> None:
        with self._lock:
            for token in self._issued.values():
                token.valid = token.valid and token.pod != pod

    def review(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The status the API gives a TokenReview of `spec`."""
        audiences = spec.get("audiences") or [API_AUDIENCE]
        with self._lock:
            issued = self._issued.get(str(spec.get("token")))
        if issued is None:
            return {"user": {}, "error": "[invalid bearer token, token could not be validated]"}
        if not issued.valid:
            return {"user": {}, "error": "[invalid bearer token, service account token has been invalidated]"}
        if issued.audience not in audiences:
            error = f'token audiences ["{issued.audience}"] is invalid for the target audiences {json.dumps(audiences)}'
            return {"user": {}, "error": f"[invalid bearer token, {error}]"}
        extra = {POD_NAME: [issued.pod], **({NODE_NAME: [issued.node]} if issued.node is not None else {})}
        groups = ["system:serviceaccounts", f"system:serviceaccounts:{self.namespace}", "system:authenticated"]
        username = f"system:serviceaccount:{self.namespace}:{issued.account}"
        user = {"username": username, "uid": f"uid-{issued.account}", "groups": groups, "extra": extra}
        return {"authenticated": True, "user": user, "audiences": [issued.audience]}
