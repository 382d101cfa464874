"""The node registry: each node's connection, its last status, and the health poller.

Health (spec: Node as seen by the gateway): every ``poll_interval_secs`` (5) the gateway asks each node for
``GET /v1/node``. After ``failures_unhealthy`` (3) failed polls in a row a node takes no new sandboxes and calls
on its sandboxes answer 503; once it has been down ``lost_after_secs`` (300) it is lost. A node that answers again
is healthy at once and its sandboxes are reconciled from its own listing. A cordon the gateway set (or a drain)
is restored on every poll, since a node clears its own cordon when it restarts.

Endpoints: ``https://host:port`` (optionally a CA file, a client certificate and key), ``unix:///path``, or
``http://host:port`` on loopback only. A token file's contents are sent as the bearer token.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from sbx.api.errors import BadGateway, InvalidRequest, SandboxError
from sbx.client._endpoint import error_for
from sbx.gateway.placement import Candidate, Resources
from sbx.gateway.state import NodeDef, now_rfc3339
from sbx.net.loopback import is_loopback

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_SECS = 5.0
DEFAULT_FAILURES_UNHEALTHY = 3
DEFAULT_LOST_AFTER_SECS = 300.0
DEFAULT_FORGET_INTERVAL_SECS = 60.0
#: Seconds to connect to a node before the call counts as the node not answering.
CONNECT_TIMEOUT_SECS = 5.0


@dataclass(frozen=True)
class Target:
    """Where a node listens: ``socket_path`` for unix, else ``host``/``port`` and TLS for https."""

    base_url: str
    socket_path: str | None
    host: str
    port: int
    tls: bool


def parse_endpoint(endpoint: str) -> Target:
    """Check and split a node endpoint; raises ``InvalidRequest`` naming the accepted forms."""
    forms = "use https://HOST:PORT, unix:///PATH, or http://HOST:PORT on loopback"
    if endpoint.startswith("unix://"):
        path = endpoint[len("unix://") :]
        if not path.startswith("/"):
            raise InvalidRequest(f"node endpoint {endpoint!r} needs an absolute socket path: unix:///PATH")
        return Target("http://localhost", path, "localhost", 0, False)
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(f"node endpoint {endpoint!r} is not accepted: {forms}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidRequest(f"node endpoint {endpoint!r} takes no path or query: {forms}")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise InvalidRequest(
            f"node endpoint {endpoint!r}: plain http is allowed on loopback only (the token would travel in "
            "clear); use https"
        )
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise InvalidRequest(f"node endpoint {endpoint!r} has a bad port: {forms}") from None
    return Target(f"{parts.scheme}://{parts.netloc}", None, parts.hostname, port, parts.scheme == "https")


def read_token_file(path: str | None) -> str | None:
    if path is None:
        return None
    token = Path(path).read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


@dataclass
class Node:
    """One node: its definition, connection, and what the poller last saw."""

    definition: NodeDef
    target: Target
    token: str | None
    ssl_context: ssl.SSLContext | None
    session: aiohttp.ClientSession
    healthy: bool = False
    answered_once: bool = False
    failures: int = 0
    #: Monotonic and wall time of the first failed poll of the current outage (None while answering).
    down_since_mono: float | None = None
    down_since: str | None = None
    last_seen: str | None = None
    error: str | None = None
    status: dict[str, Any] | None = None
    #: Monotonic time of the last reconcile from the node's listing.
    reconciled_at: float = 0.0
    poll_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _auth_headers: dict[str, str] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.definition.name

    def url(self, path_qs: str) -> str:
        return self.target.base_url + path_qs

    def headers(self) -> dict[str, str]:
        """A fresh dict of the headers every call to the node carries (its token)."""
        return dict(self.auth_headers)

    @property
    def auth_headers(self) -> dict[str, str]:
        """The same, shared and built once (not to be changed): aiohttp copies what it is given."""
        if self._auth_headers is None:
            self._auth_headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return self._auth_headers

    def is_lost(self, lost_after_secs: float) -> bool:
        return (
            not self.healthy
            and self.down_since_mono is not None
            and time.monotonic() - self.down_since_mono >= lost_after_secs
        )

    def candidate(self, cordoned: bool) -> Candidate:
        status = self.status or {}
        cap = status.get("capacity") or {}
        free = status.get("free") or {}
        return Candidate(
            name=self.name,
            taking_new=self.healthy and not cordoned and not status.get("cordoned", False),
            capacity=Resources(
                int(cap.get("cpus", 0)), int(cap.get("memory_mb", 0)), int(cap.get("disk_mb", 0))
            ),
            free=Resources(
                int(free.get("cpus", 0)), int(free.get("memory_mb", 0)), int(free.get("disk_mb", 0))
            ),
            running=int(status.get("running", 0)),
        )

    async def call(self, method: str, path: str, json_body: Any = None, timeout_secs: float = 30.0) -> Any:
        """One JSON call to the node; a non-2xx answer raises its ``SandboxError``, no answer ``BadGateway``."""
        try:
            async with self.session.request(
                method, self.url(path), json=json_body, headers=self.headers(),
                timeout=aiohttp.ClientTimeout(total=timeout_secs, connect=CONNECT_TIMEOUT_SECS),
            ) as resp:  # fmt: skip
                body = await resp.read()
                if resp.status >= 300:
                    raise error_for(resp.status, body)
                return await resp.json(content_type=None) if body else None
        except SandboxError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise BadGateway(f"node {self.name} did not answer: {describe(exc)}") from exc


def describe(exc: BaseException) -> str:
    """A short, secret-free description of a connection failure."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    return type(exc).__name__ + (f": {exc}" if str(exc) else "")


def make_ssl_context(definition: NodeDef) -> ssl.SSLContext | None:
    if not definition.endpoint.startswith("https://"):
        return None
    context = ssl.create_default_context(cafile=definition.ca_file)
    if definition.cert_file:
        context.load_cert_chain(definition.cert_file, definition.key_file)
    return context


def connect_node(definition: NodeDef) -> Node:
    """A node with its own connection pool (keep-alive); raises ``InvalidRequest`` or ``OSError``/``ValueError``
    for a bad endpoint or unreadable files."""
    target = parse_endpoint(definition.endpoint)
    token = read_token_file(definition.token_file)
    context = make_ssl_context(definition)
    connector: aiohttp.BaseConnector
    if target.socket_path is not None:
        connector = aiohttp.UnixConnector(path=target.socket_path, limit=0)
    else:
        connector = aiohttp.TCPConnector(ssl=context if context is not None else False, limit=0)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    return Node(definition, target, token, context, session)


#: Called after a node answered a poll again (first answer or after an outage) to reconcile its sandboxes.
ReconcileHook = Callable[[Node], Awaitable[None]]


class Registry:
    """Every node the gateway knows, and the poller that keeps their health and status."""

    def __init__(
        self,
        *,
        poll_interval_secs: float = DEFAULT_POLL_INTERVAL_SECS,
        failures_unhealthy: int = DEFAULT_FAILURES_UNHEALTHY,
        lost_after_secs: float = DEFAULT_LOST_AFTER_SECS,
        wanted_cordon: Callable[[str], bool] = lambda name: False,
    ) -> None:
        self.nodes: dict[str, Node] = {}
        self.poll_interval_secs = poll_interval_secs
        self.failures_unhealthy = failures_unhealthy
        self.lost_after_secs = lost_after_secs
        self.wanted_cordon = wanted_cordon
        self.on_answering_again: list[ReconcileHook] = []
        self._task: asyncio.Task[None] | None = None

    def add(self, node: Node) -> None:
        self.nodes[node.name] = node

    async def remove(self, name: str) -> None:
        node = self.nodes.pop(name, None)
        if node is not None:
            await node.session.close()

    def get(self, name: str) -> Node | None:
        return self.nodes.get(name)

    def healthy(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.healthy]

    def candidates(self) -> list[Candidate]:
        return [n.candidate(self.wanted_cordon(n.name)) for n in self.nodes.values()]

    async def start(self) -> None:
        await asyncio.gather(*(self.poll(n) for n in list(self.nodes.values())))
        self._task = asyncio.create_task(self._loop(), name="gateway-node-poller")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for node in list(self.nodes.values()):
            await node.session.close()

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            await asyncio.gather(*(self.poll(n) for n in list(self.nodes.values())), return_exceptions=True)
            await asyncio.sleep(max(0.0, self.poll_interval_secs - (time.monotonic() - started)))

    async def poll(self, node: Node) -> None:
        """One health poll of ``node``; never raises (a failure is recorded on the node)."""
        async with node.poll_lock:
            timeout = max(1.0, min(self.poll_interval_secs, 5.0))
            try:
                status = await node.call("GET", "/v1/node", timeout_secs=timeout)
                if not isinstance(status, dict):
                    raise BadGateway("the node's status is not a JSON object")
                if self.wanted_cordon(node.name) and not status.get("cordoned"):
                    # The node restarted (a restart clears its own cordon): restore ours.
                    status = await node.call(
                        "POST", "/v1/node/cordon", {"cordoned": True}, timeout_secs=timeout
                    )
            except Exception as exc:  # noqa: BLE001 - any failure is a failed poll
                self._failed(node, exc)
                return
            was_healthy = node.healthy
            node.status = status
            node.failures = 0
            node.healthy = True
            node.answered_once = True
            node.down_since_mono = None
            node.down_since = None
            node.error = None
            node.last_seen = now_rfc3339()
            if not was_healthy:
                log.info("node answering", extra={"node": node.name})
                for hook in self.on_answering_again:
                    try:
                        await hook(node)
                    except Exception:
                        log.exception("reconciling node failed", extra={"node": node.name})

    def _failed(self, node: Node, exc: BaseException) -> None:
        node.failures += 1
        node.error = exc.message if isinstance(exc, SandboxError) else describe(exc)
        if node.down_since_mono is None:
            node.down_since_mono = time.monotonic()
            node.down_since = now_rfc3339()
        if node.healthy and node.failures >= self.failures_unhealthy:
            node.healthy = False
            log.warning("node not answering", extra={"node": node.name, "failures": node.failures})
        elif not node.answered_once and node.failures >= self.failures_unhealthy:
            node.healthy = False

    def node_wire(self, node: Node, cordoned: bool) -> dict[str, Any]:
        """The spec's Node record (plus ``cordoned`` and ``lost``)."""
        wire: dict[str, Any] = {
            "name": node.name,
            "endpoint": node.definition.endpoint,
            "healthy": node.healthy,
            "last_seen": node.last_seen,
            "cordoned": cordoned,
            "lost": node.is_lost(self.lost_after_secs),
            "from_node_file": node.definition.from_file,
        }
        if node.error is not None:
            wire["error"] = node.error
        if node.status is not None:
            wire["status"] = node.status
        return wire
