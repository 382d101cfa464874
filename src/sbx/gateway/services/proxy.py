"""The services' traffic front: HTTP (and upgrades such as WebSocket) to a service's healthy replicas, on the
gateway's own listener (spec: Services; docs/services.md, "Traffic").

Addresses (``url`` of a service with a ``port``):

- ``<scheme>://<gateway>/svc/<label>/...``: always; the prefix is taken off before the request reaches the
  replica and passed on as ``X-Forwarded-Prefix``;
- ``<scheme>://<label>.<domain>/...``: with ``--services-domain DOMAIN`` (a wildcard DNS name pointing at the
  gateway); the path reaches the replica as sent.

``<label>`` is the service's name, followed by ``--<tenant>`` outside the default tenant (neither has ``--``, so
the label is one DNS label and one wildcard certificate covers every service).

Who may call: ``public: true``, anyone (connections without a key counted against the public services' caps,
``public.py``); otherwise a key acting in the service's tenant (its own, or through ``X-Sandbox-Org``; an admin key
anywhere) with ``sandbox:read``, sent as ``Authorization: Bearer sgk_...``, which the replica never sees however
it is spelled (``auth.carries_gateway_key``, over the parse authentication uses). Traffic flows only while the service's owner holds an active key in the tenant: revoking
the last one stops it at once, open requests included (503), as a revoked caller's key ends its own (401 or cut).

Which replicas are healthy: on the leader, its own checks; on every other replica, the health the leader recorded
(``ServiceController.view``; docs/ha.md). A replica a request could not reach (no tunnel, nothing answered) is
tried last by this gateway for a while, whatever the checks say yet.

How: each request goes to the next healthy replica in turn, through its node's tunnel to the replica's ``port``
(``sbx-tunnel/1``), as HTTP/1.1 (``h11``), over connections kept alive per replica (at most
:data:`IDLE_PER_REPLICA` idle, closed after :data:`IDLE_SECS`). A replica that cannot be reached is skipped for
the next one, as long as nothing of the request was sent. Hop-by-hop headers are dropped and
``X-Forwarded-For``, ``-Host`` and ``-Proto`` added. An upgrade answered 101 switches both sides and copies
bytes until both ends close. Request bodies are capped at 64 MiB. A replica has the service's
``answer_timeout_secs`` to begin its answer (504 and the tunnel closed after; no limit once it has begun).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import h11
from aiohttp import web
from msgspec import UNSET

from sbx.api.errors import (
    BadGateway,
    GatewayTimeout,
    NotFound,
    PayloadTooLarge,
    SandboxError,
    Unauthorized,
    Unavailable,
)
from sbx.gateway import auth
from sbx.gateway.http import ROUTE_LABEL
from sbx.gateway.nodeclient import NodeClient, Refusal
from sbx.gateway.relay import copy_stream
from sbx.gateway.services.public import PublicConnections
from sbx.gateway.services.spec import answer_timeout_secs
from sbx.gateway.services.store import ServiceRecord
from sbx.net.loopback import host_header_name
from sbx.web.connections import anonymous_connection, mark_authenticated
from sbx.web.http import FILE_BODY_CAP, Handler, error_response
from sbx.web.upgrade import finished_response, take_over

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway
    from sbx.gateway.services.controller import ReplicaRuntime, ServiceController

log = logging.getLogger(__name__)

#: The route label of service traffic in metrics and the audit log (never a service's name).
ROUTE = "/svc/{service}"
PATH_PREFIX = "/svc/"
IDLE_PER_REPLICA = 8
IDLE_SECS = 30.0
READ_CHUNK = 64 * 1024
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "expect",
})  # fmt: skip


@dataclass
class _Upstream:
    """One HTTP/1.1 connection to a replica's port, through its node's tunnel."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    conn: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))
    idle_since: float = 0.0

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof() and self.conn.our_state is h11.IDLE

    def close(self) -> None:
        self.writer.close()

    async def send(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def next_event(self) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(await self.reader.read(READ_CHUNK))


@dataclass(eq=False)
class _Open:
    """A request being proxied: whose, to which service, and how to end it."""

    service_id: str
    key_id: str | None
    user: str
    tenant: str
    key_tenant: str
    task: asyncio.Task[Any] | None = None
    answered: bool = False
    why: SandboxError | None = None
    closers: list[Any] = field(default_factory=list)


class ServiceFront:
    """The middleware that answers service traffic, and what it keeps (connections, open requests)."""

    def __init__(
        self,
        gw: Gateway,
        controller: ServiceController,
        domain: str | None,
        public: PublicConnections | None = None,
    ) -> None:
        self.gw = gw
        self.ctl = controller
        #: Connections without a key to public services, and their caps.
        self.public = public if public is not None else PublicConnections()
        controller.metrics.public = self.public
        self.domain = domain.lower().strip(".") if domain else None
        self._domain_host = host_header_name(self.domain) if self.domain else ""
        self._idle: dict[str, list[_Upstream]] = {}
        self._open: set[_Open] = set()
        controller.on_access_lost.append(self.end_service)

    # -- addresses --------------------------------------------------------------------------------------

    @staticmethod
    def label(svc: ServiceRecord) -> str:
        return svc.name + (f"--{svc.tenant}" if svc.tenant else "")

    def url(self, svc: ServiceRecord, request: web.Request) -> str | None:
        """Where ``svc``'s traffic is served, as the caller reached the gateway (None without a ``port``)."""
        if svc.spec.port is UNSET:
            return None
        if self.domain:
            return f"{request.scheme}://{self.label(svc)}.{self.domain}/"
        return f"{request.scheme}://{request.host}{PATH_PREFIX}{self.label(svc)}/"

    def _match(self, request: web.Request) -> tuple[str, str, str] | None:
        """``(label, path and query for the replica, prefix taken off)`` when ``request`` is service traffic."""
        raw = request.rel_url.raw_path
        query = request.rel_url.raw_query_string
        if self._domain_host:
            host = host_header_name(request.headers.get("Host", ""))
            suffix = "." + self._domain_host
            if host.endswith(suffix) and "." not in host[: -len(suffix)]:
                return host[: -len(suffix)], raw + (f"?{query}" if query else ""), ""
        if raw.startswith(PATH_PREFIX):
            label, _, rest = raw[len(PATH_PREFIX) :].partition("/")
            return label, "/" + rest + (f"?{query}" if query else ""), PATH_PREFIX + label
        return None

    def _service(self, label: str) -> ServiceRecord:
        name, _, tenant = label.partition("--")
        svc = self.ctl.db.by_name(tenant, name) if name else None
        if svc is None:
            raise NotFound(f"no service {label!r} here")
        return svc

    # -- the middleware ---------------------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        found = self._match(request)
        if found is None:
            return await handler(request)
        label, target, prefix = found
        request[ROUTE_LABEL] = ROUTE
        svc = self._service(label)
        try:
            who = self._caller(request, svc)
        except _Crowded:
            refusal = error_response(Unavailable(
                f"too many connections without a key to service {svc.name!r} (or to the gateway's public services) "
                "are busy now: try again shortly"
            ), close=True)  # fmt: skip
            refusal.headers["Retry-After"] = "1"
            return refusal
        request[auth.TARGET_KEY] = svc.name
        if not self.ctl.owner_has_access(svc):
            raise Unavailable(
                "this service's owner holds no active key in its tenant: its traffic is stopped"
            )
        op = _Open(svc.id, who.key_id if who else None, who.user if who else "", who.tenant if who else "",
                   who.key_tenant if who else "")  # fmt: skip
        task = asyncio.current_task()
        assert task is not None
        op.task = task
        self._open.add(op)
        try:
            response = await self._forward(request, svc, target, prefix, op)
        except asyncio.CancelledError:
            if op.why is None or task.cancelling() != 1:
                raise
            task.uncancel()
            if not op.answered:
                raise op.why from None
            if request.transport is not None:
                request.transport.close()
            return finished_response()
        finally:
            self._open.discard(op)
        self.ctl.metrics.count_request(response.status)
        return response

    def _caller(self, request: web.Request, svc: ServiceRecord) -> auth.Principal | None:
        """The key a private service needs (see the module docstring); None for a public service, whose
        connections without a valid key are counted against the public services' caps (``public.py``;
        ``_Crowded`` when no room can be made)."""
        if svc.spec.public is True:
            self._admit_public(request, svc)
            return None
        key = auth.key_from_header(self.gw.store, request.headers.get("Authorization"))
        mark_authenticated(request)
        request[auth.PRINCIPAL_KEY] = auth.Principal.of_key(key)
        tenant, org = auth.acting_tenant(self.gw.store, key, request.headers.getall(auth.ORG_HEADER, []))
        principal = auth.Principal.of_key(key, tenant, org)
        request[auth.PRINCIPAL_KEY] = principal
        if not principal.admin and principal.tenant != svc.tenant:
            raise NotFound(f"no service {self.label(svc)!r} here")
        auth.check_scopes(principal, ("sandbox:read",))
        return principal

    def _admit_public(self, request: web.Request, svc: ServiceRecord) -> None:
        conn = anonymous_connection(request)
        if conn is None:
            return  # a unix socket, or a connection that authenticated already
        if request.headers.get("Authorization") is not None:
            # A valid key takes the connection out of every count, as on the API; anything else is no key.
            with contextlib.suppress(Unauthorized):
                auth.key_from_header(self.gw.store, request.headers.get("Authorization"))
                mark_authenticated(request)
                return
        if not self.public.admit(conn, svc.id):
            raise _Crowded

    # -- forwarding -------------------------------------------------------------------------------------

    async def _forward(
        self, request: web.Request, svc: ServiceRecord, target: str, prefix: str, op: _Open
    ) -> web.StreamResponse:
        replicas = self.ctl.pick(svc.id)
        if not replicas:
            raise Unavailable(f"service {svc.name!r} has no healthy replica now; try again shortly")
        if request.content_length is not None and request.content_length > FILE_BODY_CAP:
            raise PayloadTooLarge(
                f"request body of {request.content_length} bytes is over the {FILE_BODY_CAP}-byte limit"
            )
        head = self._head(request, target, prefix)
        has_body = request.body_exists
        problem: SandboxError | None = None
        for rep in replicas:
            port = self._port(svc, rep)
            if port is None:
                continue
            node = self.gw.registry.get(rep.rec.node)
            if node is None or not node.healthy:
                continue
            try:
                up = await self._connect(node.client, rep.rec.sandbox, port)
            except SandboxError as exc:
                problem = exc
                self.ctl.mark_down(rep.rec.sandbox)
                continue
            op.closers.append(up.close)
            try:
                response = await self._exchange(
                    request, up, target, head, rep, op, answer_timeout_secs(svc.spec)
                )
            except _NothingSent as exc:
                problem = BadGateway(f"a replica of {svc.name!r} did not take the request: {exc}")
                self.ctl.mark_down(rep.rec.sandbox)
                if has_body:
                    break
                continue
            self.ctl.mark_up(rep.rec.sandbox)
            return response
        raise problem or Unavailable(f"service {svc.name!r} has no reachable replica now; try again shortly")

    def _port(self, svc: ServiceRecord, rep: ReplicaRuntime) -> int | None:
        spec = self.ctl.db.revisions.get((svc.id, rep.rec.revision))
        port = spec.port if spec is not None else svc.spec.port
        return port if isinstance(port, int) else None

    @staticmethod
    def _head(request: web.Request, target: str, prefix: str) -> list[tuple[str, str]]:
        named = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
        headers: list[tuple[str, str]] = [("Host", request.headers.get("Host", "localhost"))]
        for name, value in request.headers.items():
            lowered = name.lower()
            if lowered in HOP_BY_HOP or lowered in named or lowered.startswith("x-forwarded-"):
                continue
            if lowered == "authorization" and auth.carries_gateway_key(value):
                continue  # the gateway's own key never reaches the replica, however it is spelled
            if lowered == auth.ORG_HEADER.lower():
                continue
            headers.append((name, value))
        upgrade = request.headers.get("Upgrade")
        if upgrade and "upgrade" in named:
            headers += [("Connection", "Upgrade"), ("Upgrade", upgrade)]
        if request.body_exists and request.content_length is None:
            headers.append(("Transfer-Encoding", "chunked"))
        headers += [
            ("X-Forwarded-For", request.remote or ""), ("X-Forwarded-Host", request.headers.get("Host", "")),
            ("X-Forwarded-Proto", request.scheme),
        ]  # fmt: skip
        if prefix:
            headers.append(("X-Forwarded-Prefix", prefix))
        return [(n, v) for n, v in headers if v]

    async def _connect(self, client: NodeClient, sandbox: str, port: int) -> _Upstream:
        idle = self._idle.get(sandbox, [])
        while idle:
            up = idle.pop()
            if up.usable() and time.monotonic() - up.idle_since < IDLE_SECS:
                return up
            up.close()
        opened = await client.open_tunnel(sandbox, port)
        if isinstance(opened, Refusal):
            raise BadGateway(f"the node refused the tunnel to the replica (HTTP {opened.status})")
        return _Upstream(*opened)

    def _release(self, sandbox: str, up: _Upstream) -> None:
        if up.conn.our_state is h11.DONE and up.conn.their_state is h11.DONE:
            up.conn.start_next_cycle()
            idle = self._idle.setdefault(sandbox, [])
            if len(idle) < IDLE_PER_REPLICA:
                up.idle_since = time.monotonic()
                idle.append(up)
                return
        up.close()

    async def _exchange(
        self, request: web.Request, up: _Upstream, target: str, head: list[tuple[str, str]], rep: ReplicaRuntime,
        op: _Open, answer_timeout: float,
    ) -> web.StreamResponse:  # fmt: skip
        """One request to one replica. The replica has ``answer_timeout`` seconds to take each part of the
        request and then to begin its answer (the final status line, or a 101); once it has, there is no limit
        (server-sent events, long downloads). Past it the client gets 504 and the tunnel is closed."""
        released = False
        try:
            try:
                event = await self._ask(request, up, target, head, answer_timeout)
            except TimeoutError:
                log.info("a replica did not answer in time",
                         extra={"sandbox": rep.rec.sandbox, "timeout_secs": answer_timeout})  # fmt: skip
                raise GatewayTimeout(
                    f"the replica did not begin its answer within {answer_timeout:g} s (the service's "
                    "answer_timeout_secs)"
                ) from None
            if isinstance(event, h11.ConnectionClosed):
                raise _NothingSent("the replica closed the connection")
            if isinstance(event, h11.InformationalResponse):
                return await self._switch(request, up, event, op)
            assert isinstance(event, h11.Response)
            out = web.StreamResponse(status=event.status_code, reason=event.reason.decode("latin-1") or None)
            named = {t.strip().lower() for t in _header(event.headers, b"connection").split(",")}
            for raw_name, raw_value in event.headers:
                name = raw_name.decode("latin-1")
                if name.lower() in HOP_BY_HOP or name.lower() in named:
                    continue
                out.headers.add(name, raw_value.decode("latin-1"))
            length = _header(event.headers, b"content-length")
            if length.isdigit() and request.method != "HEAD":
                out.content_length = int(length)
            await out.prepare(request)
            op.answered = True
            while True:
                event = await up.next_event()
                if isinstance(event, h11.Data):
                    await out.write(bytes(event.data))
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
            await out.write_eof()
            self._release(rep.rec.sandbox, up)
            released = True
            return out
        except (OSError, h11.ProtocolError) as exc:
            log.info("service request cut", extra={"sandbox": rep.rec.sandbox, "error": type(exc).__name__})
            if op.answered:
                if request.transport is not None:
                    request.transport.close()
                return finished_response()
            raise BadGateway("the replica did not finish its answer") from None
        finally:
            if not released:
                up.close()

    async def _ask(
        self,
        request: web.Request,
        up: _Upstream,
        target: str,
        head: list[tuple[str, str]],
        answer_timeout: float,
    ) -> Any:
        """Send the request (head, body, end) and read up to the replica's answer: its status line, a 101, or the
        connection closed. Only time spent waiting on the replica counts against ``answer_timeout`` (a client
        sending its body slowly is not the replica's fault); TimeoutError past it."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(loop.time() + answer_timeout) as deadline:
            try:
                await up.send(h11.Request(method=request.method, target=target, headers=head))
            except (OSError, h11.LocalProtocolError) as exc:
                raise _NothingSent(type(exc).__name__) from None
            if request.body_exists:
                sent = 0
                deadline.reschedule(None)
                async for chunk in request.content.iter_chunked(READ_CHUNK):
                    sent += len(chunk)
                    if sent > FILE_BODY_CAP:
                        raise PayloadTooLarge(f"request body over the {FILE_BODY_CAP}-byte limit")
                    deadline.reschedule(loop.time() + answer_timeout)
                    await up.send(h11.Data(data=chunk))
                    deadline.reschedule(None)
                deadline.reschedule(loop.time() + answer_timeout)
            await up.send(h11.EndOfMessage())
            try:
                event = await up.next_event()
                while isinstance(event, h11.InformationalResponse) and event.status_code != 101:
                    event = await up.next_event()
            except (OSError, h11.RemoteProtocolError) as exc:
                raise _NothingSent(type(exc).__name__) from None
            return event

    async def _switch(
        self, request: web.Request, up: _Upstream, event: h11.InformationalResponse, op: _Open
    ) -> web.StreamResponse:
        """The replica agreed to switch protocols: pass its 101 on and copy bytes both ways."""
        lines = [f"HTTP/1.1 101 {event.reason.decode('latin-1') or 'Switching Protocols'}"]
        lines += [f"{n.decode('latin-1')}: {v.decode('latin-1')}" for n, v in event.headers]
        client = await take_over(request, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        op.answered = True
        op.closers.append(client.writer.close)
        leftover, _ = up.conn.trailing_data
        try:
            if leftover:
                client.writer.write(bytes(leftover))
            await asyncio.gather(copy_stream(client.reader, up.writer), copy_stream(up.reader, client.writer))
        finally:
            up.close()
            await client.close()
        return finished_response()

    # -- revocation -------------------------------------------------------------------------------------

    def end_service(self, service_id: str) -> None:
        """The owner lost access (or the service is gone): end its open requests."""
        self._end(lambda op: op.service_id == service_id,
                  Unavailable("this service's traffic was stopped: its owner holds no active key in its tenant"))  # fmt: skip

    async def access_changed(self) -> None:
        """End open requests whose key was revoked, lost ``sandbox:read``, or the membership it acted through."""
        store = self.gw.store

        def bad(op: _Open) -> bool:
            if op.key_id is None:
                return False
            if not auth.is_key_still_good(store, op.key_id, ("sandbox:read",)):
                return True
            return not auth.has_access(store, op.user, op.tenant, "sandbox:read")

        self._end(
            bad,
            Unauthorized("this request was ended because its API key was revoked or lost the scope it needs"),
        )

    def _end(self, chosen: Any, why: SandboxError) -> None:
        for op in [o for o in list(self._open) if o.why is None and chosen(o)]:
            op.why = why
            for close in op.closers:
                with contextlib.suppress(Exception):
                    close()
            if op.task is not None:
                op.task.cancel()

    async def close(self) -> None:
        for idle in self._idle.values():
            for up in idle:
                up.close()
        self._idle.clear()
        self._end(lambda op: True, Unavailable("the gateway is stopping"))


class _Crowded(Exception):
    """No room for another connection without a key to a public service (see ``public.py``)."""


class _NothingSent(Exception):
    """The replica failed before any of its answer arrived (another may take the request)."""


def _header(headers: Any, name: bytes) -> str:
    for key, value in headers:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return ""
