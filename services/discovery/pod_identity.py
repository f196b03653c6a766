"""A host is who its pod is: on Kubernetes, discovery takes an agent's `register` in a host's name only from the pod
of that name, as the kubelet's TLS bootstrap binds a node's name to its credentials. This module owns that check:
the TokenReview call, the verdict on its answer, the (host, incarnation) pairs proven, and the threads that make the
calls while the discovery loop goes on.

The agent sends its pod's projected service-account token (`pod_token`, read from ELASTIC_POD_TOKEN_FILE at every
register: the kubelet rotates it). Discovery, run with --kubernetes-token-audience AUD and --kubernetes-agent-account
ACCOUNT, POSTs a TokenReview {spec: {token, audiences: [AUD]}} with its own service account's token (the ApiServer of
services/discovery/kubernetes.py) and accepts the host only where the API answers: authenticated, for AUD, the user
system:serviceaccount:NS:ACCOUNT, of the pod named as the host (extra authentication.kubernetes.io/pod-name: the
chart's agents run `--host <pod name>`). The pod's node (authentication.kubernetes.io/node-name, where the API names
it) is logged with the host (`pod_identity_proven`).

Refused with `forbidden` and one warning, `pod_identity_refused`, naming the host and why (never the token): no token,
one the API does not authenticate (unknown, expired, for another audience), another service account's, another
pod's. The same register again (host, incarnation and token) is refused from memory, without a review or a line. An
API that does not answer (unreachable, discovery's own account refused, 429, 5xx) refuses `unavailable`: the agent's
link registers again at its next heartbeat. That is said once per outage (`pod_identity_unavailable`, then
`pod_identity_recovered`). A (host, incarnation) proven once is not reviewed again: heartbeats carry no token, and
a new incarnation (an agent restarted, or anyone else) is reviewed before it replaces the host's record.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_control_plane.bus.service import DEFERRED, Request, RequestError
from elastic_control_plane.services.discovery.kubernetes import ApiServer, status_message

REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
POD_NAME = "authentication.kubernetes.io/pod-name"
NODE_NAME = "authentication.kubernetes.io/node-name"
REVIEWERS = 4  # reviews at once: a fleet of agents starting together is not reviewed one by one
REVIEW_TIMEOUT = 10.0  # seconds an answer to a review is waited for
MAX_TOKEN = 16 * 1024  # characters: a projected token has one to two thousand
MAX_ANSWER = 64 * 1024  # bytes of the API's answer read
REFUSALS_KEPT = 1024  # refused (host, incarnation, token) kept to answer their retries from memory


@dataclass(frozen=True)
class Identity:
    """Who a token proves its holder is: the pod, and its node where the API says."""

    pod: str
    node: str | None


class NotThisHost(Exception):
    """The token does not prove the host's name; the message says why, never the token."""


class ReviewUnavailable(Exception):
    """The API did not answer the review: try again later."""


def service_account_user(namespace: str, account: str) -> str:
    return f"system:serviceaccount:{namespace}:{account}"


def _first(values: Any) -> str | None:
    """The first of an `extra` entry's values (the API gives each as a list)."""
    if isinstance(values, list) and values and isinstance(values[0], str):
        return values[0]
    return None


def judge(status: dict[str, Any], host: str, audience: str, user: str) -> Identity:
    """The identity a TokenReview's `status` proves for a register of `host`; NotThisHost when it proves none, or
    another pod's."""
    if status.get("authenticated") is not True:
        raise NotThisHost(f"the API does not authenticate its token: {status.get('error') or 'unknown or expired'}")
    if audience not in (status.get("audiences") or []):
        raise NotThisHost(f"its token is not for the audience {audience!r}")
    who = status.get("user") if isinstance(status.get("user"), dict) else {}
    if who.get("username") != user:
        raise NotThisHost(f"its token is {who.get('username')!r}'s, not the agents' service account {user!r}")
    extra = who.get("extra") if isinstance(who.get("extra"), dict) else {}
    pod, node = _first(extra.get(POD_NAME)), _first(extra.get(NODE_NAME))
    if pod is None:
        raise NotThisHost("its token is bound to no pod")
    if pod != host:
        raise NotThisHost(f"its token is pod {pod!r}'s, which may register as host {pod!r} only")
    return Identity(pod, node)


def review(api: ApiServer, token: str, audience: str) -> dict[str, Any]:
    """POST a TokenReview of `token` for `audience`; the answer's status, or ReviewUnavailable."""
    spec = {"token": token, "audiences": [audience]}
    body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec})
    connection = api.connection()
    try:
        api.connect(connection, REVIEW_TIMEOUT)
        headers = {**api.headers(), "Content-Type": "application/json"}
        connection.request("POST", REVIEW_PATH, body, headers=headers)
        response = connection.getresponse()
        answer = response.read(MAX_ANSWER)
    except (OSError, http.client.HTTPException) as exc:
        raise ReviewUnavailable(f"{api.url} did not answer: {exc}") from None
    finally:
        connection.close()
    if response.status not in (200, 201):
        raise ReviewUnavailable(f"{api.url}: HTTP {response.status} to create tokenreviews: {status_message(answer)}")
    try:
        status = json.loads(answer)["status"]
    except (ValueError, KeyError, TypeError):
        status = None
    if not isinstance(status, dict):
        raise ReviewUnavailable(f"{api.url} answered a TokenReview without a status")
    return status


@dataclass
class _Review:
    request: Request
    then: Callable[[Request], dict[str, Any]]
    key: tuple[str, str, str]  # host, incarnation, the token's digest
    token: str
    outcome: Identity | Exception | None = None  # the reviewer's verdict


class PodIdentity:
    """The check: `review()` (the loop, which parks the request) hands it to a reviewer thread; `finish()` (the loop,
    woken through `fileno()`) answers it."""

    def __init__(
        self, api: ApiServer, namespace: str, account: str, audience: str, log: Any, reviewers: int = REVIEWERS
    ) -> None:
        self.api, self.audience, self.log = api, audience, log
        self.user = service_account_user(namespace, account)
        self._proven: dict[str, str] = {}  # host -> the incarnation its pod proved
        self._refused: OrderedDict[tuple[str, str, str], str] = OrderedDict()  # -> why
        self._outage: str | None = None
        self._asked: queue.SimpleQueue[_Review | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Review] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._closed, self._closing = False, threading.Lock()  # no byte goes to a descriptor closed (and reused)
        self._threads = [
            threading.Thread(target=self._reviewer, name="token-review", daemon=True) for _ in range(reviewers)
        ]
        for thread in self._threads:
            thread.start()

    def fileno(self) -> int:
        """Readable when a review ended; `finish()` answers it."""
        return self._wake_read

    def proven(self, host: str, incarnation: str) -> bool:
        return self._proven.get(host) == incarnation

    def review(self, request: Request, host: str, incarnation: str, then: Callable[[Request], dict[str, Any]]) -> Any:
        """Check the pod token of `request`, a register of `host` as `incarnation`: DEFERRED until a reviewer thread
        has the API's answer (then `then(request)` answers it, once proven), or `forbidden` at once."""
        token = request.body.get("pod_token")
        if (token is not None and not isinstance(token, str)) or len(token or "") > MAX_TOKEN:
            raise RequestError("bad_request", f"field 'pod_token' must be a string of at most {MAX_TOKEN} characters")
        key = (host, incarnation, hashlib.sha256(token.encode()).hexdigest() if token else "")
        if key in self._refused:
            raise RequestError("forbidden", self._refused[key])
        if not token:
            raise self._refuse(key, "it sent no pod token (the agent's ELASTIC_POD_TOKEN_FILE)")
        self._asked.put(_Review(request, then, key, token))
        return DEFERRED

    def finish(self) -> None:
        """Answer the requests whose review ended."""
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                return
            self._answer(done)

    def close(self) -> None:
        with self._closing:
            self._closed = True
            os.close(self._wake_read)
            os.close(self._wake_write)
        for _ in self._threads:
            self._asked.put(None)

    def _answer(self, done: _Review) -> None:
        host, incarnation, _ = done.key
        if isinstance(done.outcome, ReviewUnavailable):
            if self._outage is None:
                self.log.warning("pod_identity_unavailable", host=host, reason=str(done.outcome))
            self._outage = str(done.outcome)
            done.request.refuse("unavailable", f"discovery cannot check host {host!r}'s pod now: {done.outcome}")
            return
        if self._outage is not None:
            self.log.warning("pod_identity_recovered")
            self._outage = None
        if not isinstance(done.outcome, Identity):
            refusal = self._refuse(done.key, str(done.outcome))
            done.request.refuse(refusal.code, refusal.message)
            return
        self._proven[host] = incarnation
        self.log.info("pod_identity_proven", host=host, pod=done.outcome.pod, node=done.outcome.node)
        try:
            done.request.reply(done.then(done.request))
        except RequestError as exc:
            done.request.refuse(exc.code, exc.message)
        except Exception as exc:  # as the service's loop does for a handler: logged, answered, the loop goes on
            self.log.exception("handler_failed", type="register", host=host)
            done.request.fail("internal", f"discovery failed on register: {type(exc).__name__}: {exc}")

    def _refuse(self, key: tuple[str, str, str], why: str) -> RequestError:
        """Say why the register of `key` is refused, once: its retries are refused from memory."""
        self.log.warning("pod_identity_refused", host=key[0], reason=why)
        self._refused[key] = f"host {key[0]!r} is registered only by its own pod: {why}"
        if len(self._refused) > REFUSALS_KEPT:
            self._refused.popitem(last=False)
        return RequestError("forbidden", self._refused[key])

    def _reviewer(self) -> None:
        """A thread: review what is asked, until close()."""
        while (asked := self._asked.get()) is not None:
            try:
                asked.outcome = judge(
                    review(self.api, asked.token, self.audience), asked.key[0], self.audience, self.user
                )
            except (NotThisHost, ReviewUnavailable) as exc:
                asked.outcome = exc
            except Exception as exc:  # an answer of a shape no API gives: not the agent's fault, tried again
                asked.outcome = ReviewUnavailable(f"{self.api.url} answered a TokenReview unreadably: {exc!r}")
            self._done.put(asked)
            with self._closing:
                if self._closed:
                    return
                try:
                    os.write(self._wake_write, b"\0")
                except BlockingIOError:
                    pass  # a full pipe wakes the loop already
