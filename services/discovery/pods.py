"""What a pod means to discovery, and the pod table a list and its watch events keep: the pure half of the
Kubernetes source (services/discovery/kubernetes.py does the HTTP).

A pod is a host named after the pod. Its slots: the annotation `elastic/slots` (a positive integer), else its
containers' `nvidia.com/gpu` limits summed, else None (the agent's own --slots decides, as for a script line
without a count). It is *listed* while it is Ready (condition Ready, status "True") and has no deletionTimestamp:
a pod being deleted leaves at once, and its agent, sent SIGTERM by Kubernetes, drains itself.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

SLOTS_ANNOTATION = "elastic/slots"
GPU_RESOURCE = "nvidia.com/gpu"
GONE = 410


class KubernetesError(Exception):
    """The API could not answer as asked."""


class Gone(KubernetesError):
    """The resourceVersion asked for is older than the API keeps (HTTP 410, or a watch ERROR event of code 410):
    list again."""


class Forbidden(KubernetesError):
    """HTTP 403: the service account lacks a verb on pods."""

    def __init__(self, verb: str, namespace: str) -> None:
        super().__init__(
            f"the service account may not {verb} pods in namespace {namespace} (RBAC: pods get, list, watch)"
        )


class Unauthorized(KubernetesError):
    """HTTP 401: the API does not take the credentials sent: the token in `token_file` (None: none is sent)."""

    def __init__(self, url: str, token_file: str | None, message: str) -> None:
        missing = (
            f"does not accept the token in {token_file} (expired, revoked, or another cluster's)"
            if token_file
            else "asks for a bearer token, and none is sent"
        )
        super().__init__(f"the API at {url} {missing}: HTTP 401 {message}".rstrip())


class Unavailable(KubernetesError):
    """HTTP 429 (too many requests) or 5xx (the API cannot answer now): tried again, after `retry_after` seconds
    where the answer's Retry-After asked for them (None: it did not)."""

    def __init__(self, status: int, retry_after: float | None, message: str) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


def pods_path(namespace: str, selector: str, **params: str) -> str:
    """The path of the pods of `namespace` that match the label selector, with further query parameters."""
    query = urlencode({"labelSelector": selector, **params})
    return f"/api/v1/namespaces/{quote(namespace, safe='')}/pods?{query}"


def check_selector(selector: str) -> str:
    """A label selector as given: terms `key=value`, `key==value` or `key!=value`, comma-joined (set-based terms
    pass through to the API as they are); ValueError for an empty one or an empty term."""
    terms = [term.strip() for term in selector.split(",")]
    if not selector.strip() or not all(terms):
        raise ValueError(f"--kubernetes-selector={selector!r}: not a label selector (want key=value[,key=value...])")
    return ",".join(terms)


def pod_name(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["name"])


def pod_slots(pod: dict[str, Any]) -> int | None:
    """The annotation `elastic/slots`, else the containers' GPU limits summed, else None; what is not a positive
    integer counts as absent."""
    annotated = _positive((pod["metadata"].get("annotations") or {}).get(SLOTS_ANNOTATION))
    if annotated is not None:
        return annotated
    limits = [
        _positive(((container.get("resources") or {}).get("limits") or {}).get(GPU_RESOURCE))
        for container in (pod.get("spec") or {}).get("containers") or []
    ]
    gpus = sum(limit for limit in limits if limit is not None)
    return gpus or None


def _positive(value: Any) -> int | None:
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() and int(text) > 0 else None


def pod_listed(pod: dict[str, Any]) -> bool:
    """Ready and not being deleted."""
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


class PodTable:
    """The listed pods as {host: slots}, and the resourceVersion a watch resumes from (None: list first)."""

    def __init__(self) -> None:
        self.hosts: dict[str, int | None] = {}
        self.resource_version: str | None = None

    def replace(self, pod_list: dict[str, Any]) -> bool:
        """Take a PodList (a list's answer); whether the listed hosts changed."""
        before = self.hosts
        self.hosts = {pod_name(pod): pod_slots(pod) for pod in pod_list.get("items") or [] if pod_listed(pod)}
        self.resource_version = str(pod_list["metadata"]["resourceVersion"])
        return self.hosts != before

    def apply(self, event: dict[str, Any]) -> bool:
        """Apply a watch event; whether the listed hosts changed. An ERROR event raises Gone (code 410) or
        KubernetesError; a BOOKMARK only moves the resourceVersion on."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == GONE:
                raise Gone(obj.get("message") or "resourceVersion too old")
            raise KubernetesError(f"watch error {obj.get('code')}: {obj.get('message')}")
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            raise KubernetesError(f"unknown watch event type {kind!r}")
        self.resource_version = str(obj["metadata"]["resourceVersion"])
        if kind == "BOOKMARK":
            return False
        name = pod_name(obj)
        before = (name in self.hosts, self.hosts.get(name))
        if kind != "DELETED" and pod_listed(obj):
            self.hosts[name] = pod_slots(obj)
        else:
            self.hosts.pop(name, None)
        return (name in self.hosts, self.hosts.get(name)) != before
