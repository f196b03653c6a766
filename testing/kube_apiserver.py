"""A Kubernetes API server on loopback for the pods of one namespace, speaking the real protocol as far as discovery
uses it (none can be installed here): list and watch, for tests of services/discovery/kubernetes.py, and TokenReview,
for tests of services/discovery/pod_identity.py.

- `GET /api/v1/namespaces/NS/pods?labelSelector=S[&limit=N][&continue=TOKEN]`: a PodList of the matching pods in
  name order, metadata.resourceVersion set; with `limit`, a page of at most N, and `metadata.continue` (with
  remainingItemCount) where more follow: the token asks for the rest as of the first page's resourceVersion.
  Selectors: equality terms (`k=v`, `k==v`, `k!=v`), comma-joined.
- the same with `watch=1&resourceVersion=RV[&allowWatchBookmarks=true][&timeoutSeconds=N]`: a chunked stream of JSON
  lines {type: ADDED | MODIFIED | DELETED | BOOKMARK | ERROR, object}, from the events after RV; an RV older than
  the bounded history kept gets an ERROR event of code 410, or HTTP 410 where `gone_over_http` is set.
  `compact()` drops the history: every RV up to then is too old, and each open watch ends as one that can no
  longer be served (the ERROR event; with `gone_over_http`, broken off, to find the 410 when it resumes).
  BOOKMARKs go out every `bookmark_every` seconds to watches that asked for them.
- `POST /apis/authentication.k8s.io/v1/tokenreviews` {spec: {token, audiences}}: 201 and the TokenReview with its
  status, as the API answers for a bound service-account token: `tokens` (testing/kube_tokens.py) issues them, as
  the kubelet asks for a pod's projected one, and judges them; a pod deleted takes the validity of its tokens along.
- `fail(status, times, verbs, retry_after)`: the next `times` requests of those verbs (by default list, continue and
  watch; `tokenreview` where named) (None: every one, until `heal()`) answered with that HTTP status and the API's
  Status object: 401 (a token not accepted), 403 (a verb the Role lacks), 410 (a continue token expired, a
  resourceVersion too old), 429 and 503 (with a Retry-After where asked), 500, 504.

Tests change pods with add_pod, set_ready, mark_deleting, delete_pod; they end every open watch as the API does at
its timeoutSeconds with end_streams, and break them off with cut_streams. `calls` records each request (a `Call`:
its verb, list, continue, watch or tokenreview, its query and when it came); `count(verb)` counts them.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from testing.kube_tokens import FORBIDDEN_REVIEW, TOKEN_REVIEWS_PATH, Tokens

Pod = dict[str, Any]
VERBS = ("list", "continue", "watch")  # continue: a later page of a list
TOKEN_REVIEW = "tokenreview"  # the verb of a TokenReview's create
REFUSALS = {  # an HTTP status the API answers: its Status reason and message ({verb}, {namespace} filled in)
    401: ("Unauthorized", "Unauthorized"),
    403: (
        "Forbidden",
        'pods is forbidden: User "system:serviceaccount:{namespace}:discovery" cannot {verb} resource "pods" in API '
        'group "" in the namespace "{namespace}"',
    ),
    410: (
        "Expired",
        "The provided continue parameter is too old to display a consistent list result. You can start a new list "
        "without the continue parameter.",
    ),
    429: ("TooManyRequests", "the server has received too many requests and has asked us to try again later"),
    500: ("InternalError", "Internal error occurred: etcdserver: request timed out"),
    503: ("ServiceUnavailable", "the server is currently unable to handle the request"),
    504: ("Timeout", "the server was unable to return a response in the time allotted, but may still be processing"),
}


@dataclass(frozen=True)
class Call:
    """A request the API server got: `verb` list (a list's first page), continue (a later page), watch, tokenreview."""

    verb: str
    query: dict[str, str]
    at: float  # time.monotonic() when it came

    @property
    def resource_version(self) -> str | None:
        return self.query.get("resourceVersion")


@dataclass
class _Failure:
    status: int
    times: int | None  # None: until heal()
    verbs: tuple[str, ...]
    retry_after: int | None


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = (part.strip() for part in term.split("!=", 1))
            if labels.get(key) == value:
                return False
            continue
        key, value = (part.strip() for part in term.replace("==", "=").split("=", 1))
        if labels.get(key) != value:
            return False
    return True


class KubeApiServer:
    """The API server, serving on 127.0.0.1 (`url`) from construction until `close()`."""

    def __init__(self, namespace: str = "default", history: int = 1000, bookmark_every: float | None = None) -> None:
        self.namespace = namespace
        self.bookmark_every = bookmark_every
        self.gone_over_http = False
        self.calls: list[Call] = []
        self._pods: dict[str, Pod] = {}
        self._version = 100
        self._history: deque[tuple[int, str, Pod]] = deque(maxlen=history)
        self._too_old = 0  # a watch from this resourceVersion or an older one gets 410 Gone
        self._compactions = 0
        self._failures: list[_Failure] = []
        self.tokens = Tokens(namespace)
        self._cuts = 0
        self._endings = 0
        self._closing = False
        self._changed = threading.Condition()
        handler = type("Handler", (_Handler,), {"api": self})
        self._server = _Server(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # -- what tests do to the pods -------------------------------------------------------------
    def add_pod(
        self, name: str, labels: dict[str, str], gpus: int = 0, annotations: dict[str, str] | None = None
    ) -> None:
        limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
        pod = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"name": name, "namespace": self.namespace, "labels": labels, "annotations": annotations or {}},
            "spec": {"containers": [{"name": "agent", "resources": {"limits": limits}}]},
            "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]},
        }
        self._record("ADDED", name, pod)

    def set_ready(self, name: str, ready: bool) -> None:
        pod = json.loads(json.dumps(self._pods[name]))
        pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        self._record("MODIFIED", name, pod)

    def mark_deleting(self, name: str) -> None:
        pod = json.loads(json.dumps(self._pods[name]))
        pod["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._record("MODIFIED", name, pod)

    def delete_pod(self, name: str) -> None:
        """The pod goes, and the tokens bound to it are no longer valid."""
        self._record("DELETED", name, json.loads(json.dumps(self._pods[name])))
        self.tokens.pod_deleted(name)

    def compact(self) -> None:
        """Forget the history: a watch from any resourceVersion up to now gets 410 Gone, an open one ends."""
        with self._changed:
            self._history.clear()
            self._version += 1  # as another object's change would: a list from now on watches from after it
            self._too_old = self._version - 1
            self._compactions += 1
            self._changed.notify_all()

    def fail(
        self, status: int, times: int | None = 1, verbs: tuple[str, ...] = VERBS, retry_after: int | None = None
    ) -> None:
        """Answer the next `times` requests of `verbs` (None: every one, until `heal()`) with HTTP `status` (one of
        REFUSALS), and a Retry-After of `retry_after` seconds where given."""
        with self._changed:
            self._failures.append(_Failure(status, times, verbs, retry_after))

    def heal(self) -> None:
        with self._changed:
            self._failures.clear()

    def count(self, verb: str) -> int:
        return [call.verb for call in list(self.calls)].count(verb)

    def cut_streams(self) -> None:
        """End every open watch abruptly, as a connection that breaks."""
        with self._changed:
            self._cuts += 1
            self._changed.notify_all()

    def end_streams(self) -> None:
        """End every open watch as the API does at its timeoutSeconds: the stream's last chunk."""
        with self._changed:
            self._endings += 1
            self._changed.notify_all()

    def _record(self, kind: str, name: str, pod: Pod) -> None:
        with self._changed:
            self._version += 1
            pod["metadata"]["resourceVersion"] = str(self._version)
            if kind == "DELETED":
                del self._pods[name]
            else:
                self._pods[name] = pod
            if len(self._history) == self._history.maxlen:
                self._too_old = max(self._too_old, self._history[0][0] - 1)  # the event after it is dropped now
            self._history.append((self._version, kind, pod))
            self._changed.notify_all()

    # -- what the handler asks -----------------------------------------------------------------
    def pod_list(self, selector: str, limit: int = 0, token: str = "") -> dict[str, Any]:
        """The matching pods in name order, at most `limit` of them (0: all), from where `token` left off: the pods
        as they are now, under the first page's resourceVersion (the watch from it brings what changed since)."""
        with self._changed:
            version, start = json.loads(base64.b64decode(token)) if token else (self._version, "")
            pods = sorted((name, pod) for name, pod in self._pods.items() if name > start)
            items = [pod for _, pod in pods if selector_matches(selector, pod["metadata"]["labels"])]
        metadata: dict[str, Any] = {"resourceVersion": str(version)}
        if limit and len(items) > limit:
            items, metadata["remainingItemCount"] = items[:limit], len(items) - limit
            token = json.dumps([version, items[-1]["metadata"]["name"]])  # where the next page starts
            metadata["continue"] = base64.b64encode(token.encode()).decode()
        return {"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": items}

    def failure(self, verb: str) -> _Failure | None:
        """The failure this request is answered with, if any (taking one of its times)."""
        with self._changed:
            for failure in self._failures:
                if verb in failure.verbs and failure.times != 0:
                    if failure.times is not None:
                        failure.times -= 1
                    return failure
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (a pod source stopped, a stream cut) is no error of the server's."""


class _Handler(BaseHTTPRequestHandler):
    api: KubeApiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        api = self.api
        url = urlsplit(self.path)
        review = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        api.calls.append(Call(TOKEN_REVIEW, {}, time.monotonic()))
        if url.path != TOKEN_REVIEWS_PATH:
            return self._status(404, "NotFound", f"no such path {url.path}")
        failure = api.failure(TOKEN_REVIEW)
        if failure is not None:
            reason, message = REFUSALS[failure.status]
            message = FORBIDDEN_REVIEW if failure.status == 403 else message
            retry_after = {"Retry-After": str(failure.retry_after)} if failure.retry_after is not None else {}
            return self._status(failure.status, reason, message.format(namespace=api.namespace), retry_after)
        if review.get("kind") != "TokenReview" or not isinstance(review.get("spec"), dict):
            return self._status(400, "BadRequest", "not a TokenReview")
        status = api.tokens.review(review["spec"])
        self._json(201, {**review, "metadata": {"creationTimestamp": None}, "status": status})

    def do_GET(self) -> None:
        api = self.api
        url = urlsplit(self.path)
        query = {key: values[0] for key, values in parse_qs(url.query).items()}
        watching = query.get("watch") in ("1", "true")
        verb = "watch" if watching else "continue" if query.get("continue") else "list"
        api.calls.append(Call(verb, query, time.monotonic()))
        if url.path != f"/api/v1/namespaces/{api.namespace}/pods":
            return self._status(404, "NotFound", f"no such path {url.path}")
        failure = api.failure(verb)
        if failure is not None:
            reason, message = REFUSALS[failure.status]
            message = message.format(verb="list" if verb == "continue" else verb, namespace=api.namespace)
            if failure.status == 410 and watching:
                message = f"too old resource version: {query.get('resourceVersion')}"
            retry_after = {"Retry-After": str(failure.retry_after)} if failure.retry_after is not None else {}
            return self._status(failure.status, reason, message, retry_after)
        selector = query.get("labelSelector", "")
        if not watching:
            return self._json(200, api.pod_list(selector, int(query.get("limit") or 0), query.get("continue", "")))
        self._watch(selector, int(query.get("resourceVersion") or api._version), query)

    def _watch(self, selector: str, since: int, query: dict[str, str]) -> None:
        api = self.api
        with api._changed:
            too_old, compactions = since <= api._too_old, api._compactions
        if too_old and api.gone_over_http:
            return self._status(410, "Expired", f"too old resource version: {since} ({api._too_old})")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if too_old:
            return self._gone(since)
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") == "true" and api.bookmark_every is not None
        next_bookmark = time.monotonic() + (api.bookmark_every or 0)
        cuts, endings, cursor = api._cuts, api._endings, since
        while True:
            with api._changed:
                if not self._after(cursor):
                    api._changed.wait(
                        max(0.0, (min(deadline, next_bookmark) if bookmarks else deadline) - time.monotonic())
                    )
                gone = api._compactions != compactions and not api.gone_over_http
                ended = api._cuts != cuts or api._closing or api._compactions != compactions
                finished = api._endings != endings
                events = self._after(cursor)
            if gone:
                return self._gone(cursor)
            if ended:
                self.close_connection = True
                return  # no last chunk: the stream breaks off
            for rv, kind, pod in events:
                cursor = rv
                if selector_matches(selector, pod["metadata"]["labels"]):
                    self._chunk({"type": kind, "object": pod})
            now = time.monotonic()
            if now >= deadline or finished:
                return self._end()
            if bookmarks and now >= next_bookmark:
                bookmark = {"kind": "Pod", "metadata": {"resourceVersion": str(cursor)}}  # all before it were sent
                self._chunk({"type": "BOOKMARK", "object": bookmark})
                next_bookmark = now + (api.bookmark_every or 0)

    def _after(self, cursor: int) -> list[tuple[int, str, Pod]]:
        return [event for event in self.api._history if event[0] > cursor]

    def _gone(self, since: int) -> None:
        gone = {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410}
        self._chunk({"type": "ERROR", "object": {**gone, "message": f"too old resource version: {since}"}})
        self._end()

    def _chunk(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _json(self, code: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str, headers: dict[str, str] | None = None) -> None:
        status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message}
        self._json(code, {**status, "code": code}, headers)
