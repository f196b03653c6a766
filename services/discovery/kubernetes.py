"""Discovery from the Kubernetes API: a thread that lists, then watches, the pods matching a label selector, as
client-go's reflector does, and the host list it keeps (services/discovery/pods.py says what a pod means).

A list comes in pages (`limit`, then each `continue` token until none; a token expired, 410, lists again from the
start). The watch asks for BOOKMARK events (allowWatchBookmarks=true: they move the resourceVersion on) and to be
ended after 60 to 80 s (timeoutSeconds, drawn afresh for each watch); a stream that ends, breaks off, or says
nothing for 90 s (the read timeout) is watched again from the resourceVersion it got to. Connections have TCP
keepalive. A 410 Gone (HTTP, or a watch ERROR event) lists again at once; any other failure is tried again after a
back-off with jitter or the API's Retry-After, a watch from where it was: only a watch that failed 3 times in a row
lists again (services/discovery/kubernetes_retry.py owns that policy). The discovery loop reads `hosts()`, a dict
the thread replaces whole, and is woken through `fileno()`, a pipe the thread writes a byte to on each change.

The standard library's HTTP is enough for the two calls made (list, watch), keeps the resourceVersion handling in
view, and adds no dependency. In a pod the API is https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, with
the service account's CA and bearer token (read again for every request: bound tokens rotate);
ELASTIC_KUBERNETES_API=http://HOST:PORT names another (tests: testing/kube_apiserver.py), with no token.

What goes wrong is said once: a selector that matches no pod (`kubernetes_no_pods`), and, once per outage, a token
the API does not accept (`kubernetes_unauthorized`, 401), a verb the Role lacks (`kubernetes_forbidden`, 403), an
API that asks for fewer requests (`kubernetes_throttled`, 429), cannot answer now (`kubernetes_unavailable`, 5xx)
or cannot be reached (`kubernetes_unreachable`); `kubernetes_recovered` says when it ends. Why the pods are listed
again is said at info (`kubernetes_relist`), and a Retry-After longer than the back-off's cap
(`kubernetes_retry_after_capped`).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from elastic_control_plane.services.discovery.host_lists import HostLists
from elastic_control_plane.services.discovery.kubernetes_retry import (
    BAD_ANSWERS,
    Backoff,
    failure_event,
    leads_to_relist,
    retry_after_seconds,
)
from elastic_control_plane.services.discovery.pods import (
    Forbidden,
    Gone,
    KubernetesError,
    PodTable,
    Unauthorized,
    Unavailable,
    check_selector,
    pods_path,
)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API_ENV = "ELASTIC_KUBERNETES_API"
WATCH_SECONDS = (60, 80)  # a watch asks the API to end it after a time drawn from these (timeoutSeconds)
READ_TIMEOUT = 90.0  # seconds of silence that end a read: a watch has a BOOKMARK a minute, and ends by 80 s
CONNECT_TIMEOUT = 5.0  # seconds to open a connection to the API
KEEPALIVE = (30, 10, 3)  # TCP keepalive: a probe after 30 s idle, then every 10 s; 3 unanswered end the connection
PAGE_SIZE = 500  # pods per page of a list
QUICK_WATCH = 1.0  # seconds: a watch that ends sooner, having brought nothing, is watched again after a back-off
FAILURES = (KubernetesError, OSError, http.client.HTTPException, *BAD_ANSWERS)  # OSError, HTTPException: a read cut


def pods_and_script(script: str) -> str:
    """Why a job may not name a discovery script where discovery watches pods."""
    return (
        f"discovery takes its hosts from Kubernetes pods (--kubernetes-selector): "
        f"a job may not name a discovery script too ({script})"
    )


def default_namespace(account: Path = SERVICE_ACCOUNT) -> str:
    """The service account's namespace, outside a pod "default"."""
    try:
        return (account / "namespace").read_text().strip() or "default"
    except OSError:
        return "default"


@dataclass(frozen=True)
class ApiServer:
    """Where the API is and how to talk to it: its base URL, the CA file for https, the token file (None: none)."""

    url: str
    ca_file: Path | None = None
    token_file: Path | None = None

    @classmethod
    def from_env(cls, account: Path = SERVICE_ACCOUNT) -> ApiServer:
        """ELASTIC_KUBERNETES_API, else the API of the cluster this pod runs in; ValueError outside a pod."""
        if os.environ.get(API_ENV):
            url = os.environ[API_ENV].rstrip("/")
            if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
                raise ValueError(f"{API_ENV}={url!r}: not http://HOST:PORT or https://HOST:PORT")
            return cls(url)
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError(f"--kubernetes-selector needs the Kubernetes API: not in a pod, and {API_ENV} is unset")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", account / "ca.crt", account / "token")

    def connection(self) -> http.client.HTTPConnection:
        """A connection not yet open, whose connect gives up after CONNECT_TIMEOUT."""
        parts = urlsplit(self.url)
        if parts.scheme == "http":
            return http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=CONNECT_TIMEOUT)
        context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        return http.client.HTTPSConnection(
            parts.hostname or "", parts.port or 443, timeout=CONNECT_TIMEOUT, context=context
        )

    def connect(self, connection: http.client.HTTPConnection, read_timeout: float) -> None:
        """Open `connection` with TCP keepalive, its reads giving up after `read_timeout` seconds."""
        connection.connect()
        connection.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE):
            if hasattr(socket, option):  # Linux has all three; elsewhere the system's defaults
                connection.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        connection.sock.settimeout(read_timeout)

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token_file is not None:
            headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
        return headers


class PodSource(HostLists):
    """The hosts of the Ready pods matching `selector` in `namespace`, kept by a thread from `start()` to `stop()`.

    `hosts()` is None until the first list succeeded; `generation` counts the host lists taken."""

    def __init__(
        self,
        api: ApiServer,
        namespace: str,
        selector: str,
        log: Any,
        watch_seconds: tuple[int, int] = WATCH_SECONDS,
        read_timeout: float = READ_TIMEOUT,
        backoff: Backoff | None = None,
        page_size: int = PAGE_SIZE,
    ) -> None:
        self.api, self.namespace, self.selector, self.log = api, namespace, check_selector(selector), log
        self.watch_seconds, self.read_timeout, self.page_size = watch_seconds, read_timeout, page_size
        self.backoff = backoff or Backoff()
        self.generation = 0
        self._watch_failures = 0  # watches failed in a row: a relist after backoff.policy.rewatches
        self._rng = random.Random()  # draws each watch's timeoutSeconds
        super().__init__()
        self._table = PodTable()
        self._stopping = threading.Event()
        self._connection: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # guards _connection, which stop() shuts down under the thread's read
        self._outage: str | None = None
        self._said_no_pods = False
        self._thread = threading.Thread(target=self._run, name="kubernetes-pods", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def resource_version(self) -> str | None:
        """Where the next watch resumes (None: it lists first)."""
        return self._table.resource_version

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            if self._connection is not None and self._connection.sock is not None:
                try:
                    self._connection.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.close()

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._stopping.wait(self._step())

    def _step(self) -> float:
        """List if there is no resourceVersion to watch from, else watch; the seconds to wait before the next."""
        watching = self._table.resource_version is not None
        try:
            if not watching:
                self._list()
                return 0.0
            return 0.0 if self._watch() else self.backoff.wait()
        except Gone as exc:
            self._relist(str(exc))
            return 0.0 if watching else self.backoff.wait()  # a list's own continue token expired: after a wait
        except FAILURES as exc:
            wait = self._failed(exc)
            if watching and leads_to_relist(exc):
                self._watch_failures += 1
                if self._watch_failures >= self.backoff.policy.rewatches:
                    self._relist(f"the watch failed {self._watch_failures} times in a row, the last: {exc}")
            return wait

    def _failed(self, exc: Exception) -> float:
        """Say a failure once while it lasts; the seconds to wait before trying again."""
        event = failure_event(exc)
        retry_after = exc.retry_after if isinstance(exc, Unavailable) else None
        if self._stopping.is_set():
            return 0.0
        if self._outage != event:
            reason = repr(exc) if event == "kubernetes_bad_answer" else str(exc) or repr(exc)
            self.log.warning(event, namespace=self.namespace, selector=self.selector, reason=reason)
        self._outage = event
        if retry_after is not None and retry_after > self.backoff.policy.cap:
            self.log.info("kubernetes_retry_after_capped", retry_after=retry_after, waited=self.backoff.policy.cap)
        return self.backoff.wait(retry_after)

    def _relist(self, reason: str) -> None:
        self.log.info("kubernetes_relist", selector=self.selector, reason=reason)
        self._table.resource_version = None
        self._watch_failures = 0

    def _answered(self) -> None:
        if self._outage is not None:
            self.log.warning("kubernetes_recovered", namespace=self.namespace, selector=self.selector)
            self._outage = None

    def _watched(self) -> None:
        """A watch brought something, or ran its course: failures in a row start again from none."""
        self._watch_failures = 0
        self.backoff.reset()

    def _list(self) -> None:
        """List the pods, page after page (Gone where a continue token expired), and take them as the hosts."""
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            page_query = {"limit": str(self.page_size), **({"continue": token} if token else {})}
            try:
                with self._get("list", pods_path(self.namespace, self.selector, **page_query)) as response:
                    page = json.loads(response.read())
            except Gone as exc:
                if not token:
                    raise
                raise Gone(f"a list's continue token expired, listed again from the start: {exc}") from None
            items += page.get("items") or []
            token = page["metadata"].get("continue") or ""
            if not token:
                break
        self._answered()
        if not items and not self._said_no_pods:
            self.log.warning("kubernetes_no_pods", namespace=self.namespace, selector=self.selector)
        self._said_no_pods = self._said_no_pods or not items
        if self._table.replace({"metadata": page["metadata"], "items": items}) or self.hosts() is None:
            self._publish()

    def _watch(self) -> bool:
        """Watch from the table's resourceVersion until the stream ends; whether it brought an event or lasted
        QUICK_WATCH."""
        path = pods_path(
            self.namespace,
            self.selector,
            watch="1",
            resourceVersion=self._table.resource_version or "",
            allowWatchBookmarks="true",
            timeoutSeconds=str(self._rng.randint(*self.watch_seconds)),
        )
        began, brought = time.monotonic(), False
        with self._get("watch", path) as response:
            self._answered()
            for event in _events(response):
                if self._table.apply(event):
                    self._publish()
                brought = True
                self._watched()
        if brought or time.monotonic() - began >= QUICK_WATCH:
            self._watched()
            return True
        return False

    def _publish(self) -> None:
        self.generation += 1
        if not self._stopping.is_set():  # else the pipe is closed, or about to be
            self.put(dict(self._table.hosts))

    @contextmanager
    def _get(self, verb: str, path: str) -> Iterator[http.client.HTTPResponse]:
        """GET `path`: the response when 200, its connection closed after; Gone, Forbidden (naming `verb`) or
        KubernetesError otherwise."""
        connection = self.api.connection()
        try:
            try:
                with self._lock:  # stop() finds the connection open, or this one not opened
                    if self._stopping.is_set():
                        raise KubernetesError("stopping")
                    self._connection = connection
                    self.api.connect(connection, self.read_timeout)
                connection.request("GET", path, headers=self.api.headers())
                response = connection.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise KubernetesError(f"{self.api.url}: {exc}") from None
            if response.status == 200:
                yield response
                return
            raise self._refusal(verb, response)
        finally:
            connection.close()

    def _refusal(self, verb: str, response: http.client.HTTPResponse) -> KubernetesError:
        """What an answer other than 200 means."""
        status, message = response.status, status_message(response.read(2000))
        if status == 401:
            token_file = str(self.api.token_file) if self.api.token_file is not None else None
            return Unauthorized(self.api.url, token_file, message)
        if status == 403:
            return Forbidden(verb, self.namespace)
        if status == 410:
            return Gone(message)
        described = f"{self.api.url}: HTTP {status} to {verb} pods: {message}"
        if status == 429 or status >= 500:
            return Unavailable(status, retry_after_seconds(response.getheader("Retry-After")), described)
        return KubernetesError(described)


def status_message(body: bytes) -> str:
    """The message of a Status object, else the body as text."""
    try:
        return str(json.loads(body)["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace").strip()


def _events(response: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON lines of a watch stream, until it ends or is silent past the connection's timeout."""
    while True:
        try:
            line = response.readline()
        except (OSError, http.client.HTTPException):
            return  # silent past the read timeout, or cut: watched again from the last resourceVersion
        if not line.endswith(b"\n"):
            return  # the end, or a line cut short
        if line.strip():
            yield json.loads(line)
