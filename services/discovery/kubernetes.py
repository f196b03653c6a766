"""Discovery from the Kubernetes API: a thread that lists, then watches, the pods matching a label selector, and
the host list it keeps (services/discovery/pods.py says what a pod means).

The watch resumes from the last resourceVersion (BOOKMARK events move it on: allowWatchBookmarks=true); a 410 Gone
(HTTP, or a watch ERROR event) lists again; a stream that ends, or says nothing past its read timeout, is watched
again from the resourceVersion it got to. The discovery loop reads `hosts()`, a dict the thread replaces whole, and
is woken through `fileno()`, a pipe the thread writes a byte to on each change.

The standard library's HTTP is enough for the two calls made (list, watch), keeps the resourceVersion handling in
view, and adds no dependency. In a pod the API is https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, with
the service account's CA and bearer token (read again for every request: bound tokens rotate);
ELASTIC_KUBERNETES_API=http://HOST:PORT names another (tests: testing/kube_apiserver.py), with no token.

What goes wrong is said once: a selector that matches no pod (`kubernetes_no_pods`), and, once per outage, an API
that refuses (`kubernetes_forbidden`, naming the verb the Role lacks) or cannot be reached
(`kubernetes_unreachable`); both are retried with a backoff, and `kubernetes_recovered` says when they end.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from elastic_control_plane.services.discovery.pods import (
    Forbidden,
    Gone,
    KubernetesError,
    PodTable,
    check_selector,
    pods_path,
)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API_ENV = "ELASTIC_KUBERNETES_API"
WATCH_SECONDS = 300  # a watch the API server ends after this long (timeoutSeconds); it is watched again
READ_MARGIN = 30.0  # seconds of silence past WATCH_SECONDS that end a watch from this side
CONNECT_TIMEOUT = 5.0  # seconds to open a connection to the API
RETRY = (0.5, 30.0)  # seconds between tries after a failure: the first, doubling up to the last


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

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token_file is not None:
            headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
        return headers


class PodSource:
    """The hosts of the Ready pods matching `selector` in `namespace`, kept by a thread from `start()` to `stop()`.

    `hosts()` is None until the first list succeeded; `generation` counts the host lists taken."""

    def __init__(
        self,
        api: ApiServer,
        namespace: str,
        selector: str,
        log: Any,
        watch_seconds: int = WATCH_SECONDS,
        read_timeout: float = WATCH_SECONDS + READ_MARGIN,
        retry: tuple[float, float] = RETRY,
    ) -> None:
        self.api, self.namespace, self.selector, self.log = api, namespace, check_selector(selector), log
        self.watch_seconds, self.read_timeout, self.retry = watch_seconds, read_timeout, retry
        self.generation = 0
        self._hosts: dict[str, int | None] | None = None
        self._table = PodTable()
        self._stopping = threading.Event()
        self._connection: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # guards _connection, which stop() shuts down under the thread's read
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._outage: str | None = None
        self._said_no_pods = False
        self._thread = threading.Thread(target=self._run, name="kubernetes-pods", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def hosts(self) -> dict[str, int | None] | None:
        return self._hosts

    @property
    def resource_version(self) -> str | None:
        """Where the next watch resumes (None: it lists first)."""
        return self._table.resource_version

    def fileno(self) -> int:
        """A descriptor readable after a change; `take()` empties it."""
        return self._wake_read

    def take(self) -> dict[str, int | None] | None:
        """`hosts()`, the wake-ups that told of it taken from `fileno()`."""
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        return self._hosts

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
        os.close(self._wake_read)
        os.close(self._wake_write)

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        delay = self.retry[0]
        while not self._stopping.is_set():
            listed = False
            try:
                if self._table.resource_version is None:
                    self._list()
                    listed = True
                if not self._watch():
                    self._stopping.wait(self.retry[0])  # ended with nothing read: an API that ends watches at once
                delay = self.retry[0]
                continue
            except Gone as exc:
                self.log.info("kubernetes_relist", selector=self.selector, reason=str(exc))
                self._table.resource_version = None
                if not listed:
                    continue  # the watch fell behind: list again at once (a list's own version gone: after a wait)
            except Forbidden as exc:
                self._failed("kubernetes_forbidden", str(exc))
            except (KubernetesError, OSError, http.client.HTTPException) as exc:  # the last two: a read cut short
                self._failed("kubernetes_unreachable", str(exc) or repr(exc))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not the JSON of a PodList or event
                self._failed("kubernetes_bad_answer", repr(exc))
            self._stopping.wait(delay)
            delay = min(self.retry[1], delay * 2)

    def _failed(self, event: str, reason: str) -> None:
        if self._stopping.is_set():
            return
        if self._outage != event:
            self.log.warning(event, namespace=self.namespace, selector=self.selector, reason=reason)
        self._outage = event
        self._table.resource_version = None

    def _answered(self) -> None:
        if self._outage is not None:
            self.log.warning("kubernetes_recovered", namespace=self.namespace, selector=self.selector)
            self._outage = None

    def _list(self) -> None:
        with self._get("list", pods_path(self.namespace, self.selector)) as response:
            pod_list = json.loads(response.read())
        self._answered()
        items = pod_list.get("items") or []
        if not items and not self._said_no_pods:
            self.log.warning("kubernetes_no_pods", namespace=self.namespace, selector=self.selector)
        self._said_no_pods = self._said_no_pods or not items
        if self._table.replace(pod_list) or self._hosts is None:
            self._publish()

    def _watch(self) -> int:
        """Watch from the table's resourceVersion until the stream ends; how many events it brought."""
        path = pods_path(
            self.namespace,
            self.selector,
            watch="1",
            resourceVersion=self._table.resource_version or "",
            allowWatchBookmarks="true",
            timeoutSeconds=str(self.watch_seconds),
        )
        events = 0
        with self._get("watch", path) as response:
            self._answered()
            for event in _events(response):
                events += 1
                if self._table.apply(event):
                    self._publish()
        return events

    def _publish(self) -> None:
        self._hosts = dict(self._table.hosts)
        self.generation += 1
        if self._stopping.is_set():
            return  # the pipe is closed, or about to be
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):
            pass  # a full pipe wakes the loop already; a closed one: stopping

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
                    connection.connect()
                connection.sock.settimeout(self.read_timeout)
                connection.request("GET", path, headers=self.api.headers())
                response = connection.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise KubernetesError(f"{self.api.url}: {exc}") from None
            if response.status == 200:
                yield response
                return
            detail = response.read(500).decode(errors="replace")
            if response.status == 403:
                raise Forbidden(verb, self.namespace)
            if response.status == 410:
                raise Gone(detail)
            raise KubernetesError(f"{self.api.url}: HTTP {response.status} to {verb} pods: {detail}")
        finally:
            connection.close()


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
