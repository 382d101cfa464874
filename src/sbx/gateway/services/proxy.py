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
``proxying.IDLE_PER_TARGET`` idle, closed after ``proxying.IDLE_SECS``). A replica that cannot be reached is skipped for
the next one, as long as nothing of the request was sent. Hop-by-hop headers are dropped and
``X-Forwarded-For``, ``-Host`` and ``-Proto`` added. An upgrade answered 101 switches both sides and copies
bytes until both ends close. Request bodies are capped at 64 MiB. A replica has the service's
``answer_timeout_secs`` to begin its answer (504 and the tunnel closed after; no limit once it has begun).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web
from msgspec import UNSET

from sbx.api.errors import BadGateway, NotFound, SandboxError, Unauthorized, Unavailable
from sbx.gateway import auth
from sbx.gateway.http import ROUTE_LABEL
from sbx.gateway.nodeclient import Refusal
from sbx.gateway.proxying import (
    Destination,
    NothingSent,
    Proxied,
    UpstreamPool,
    check_length,
    end_where,
    exchange,
    request_head,
    serve_proxied,
)
from sbx.gateway.services.public import PublicConnections
from sbx.gateway.services.spec import answer_timeout_secs
from sbx.gateway.services.store import ServiceRecord
from sbx.net.loopback import host_header_name
from sbx.web.connections import anonymous_connection, mark_authenticated
from sbx.web.http import Handler, error_response

if TYPE_CHECKING:
    from sbx.gateway.interfaces import Freshness
    from sbx.gateway.nodes import Registry
    from sbx.gateway.services.controller import ReplicaRuntime, ServiceController
    from sbx.gateway.store.base import Store

#: The route label of service traffic in metrics and the audit log (never a service's name).
ROUTE = "/svc/{service}"
PATH_PREFIX = "/svc/"


@dataclass(eq=False)
class _Open(Proxied):
    """A request being proxied: whose, to which service."""

    service_id: str = ""
    key_id: str | None = None
    user: str = ""
    tenant: str = ""
    key_tenant: str = ""


def keep_for_replica(lowered: str, value: str) -> str | None:
    """What of a request header reaches a replica: the gateway's own key never does, however it is spelled, nor
    the organisation header."""
    if lowered == "authorization" and auth.carries_gateway_key(value):
        return None
    if lowered == auth.ORG_HEADER.lower():
        return None
    return value


class ServiceFront:
    """The middleware that answers service traffic, and what it keeps (connections, open requests).

    Given the store (the keys and memberships a caller is checked against), the node registry (the tunnels to the
    replicas), the controller (which replicas are healthy, in what order) and ``Freshness`` (its catching up with
    the other replicas); never the gateway."""

    def __init__(
        self,
        store: Store,
        registry: Registry,
        controller: ServiceController,
        domain: str | None,
        public: PublicConnections | None = None,
        *,
        fresh: Freshness,
    ) -> None:
        self.store = store
        #: Catching up with the other replicas' writes before a request is looked at (docs/ha.md).
        self.fresh = fresh
        self.registry = registry
        self.ctl = controller
        #: Connections without a key to public services, and their caps.
        self.public = public if public is not None else PublicConnections()
        controller.metrics.public = self.public
        self.domain = domain.lower().strip(".") if domain else None
        self._domain_host = host_header_name(self.domain) if self.domain else ""
        self.pool = UpstreamPool()
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
        # The service, its spec (public or not) and the caller's key as of every write acknowledged before this
        # request, through any replica (docs/ha.md): a service made or made public or private through another
        # replica a moment ago counts here at once. Best effort: while the database is out of reach no write can
        # be acknowledged, so memory is then what any replica would answer from.
        await self.fresh.caught_up()
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
        op = _Open(service_id=svc.id, key_id=who.key_id if who else None, user=who.user if who else "",
                   tenant=who.tenant if who else "", key_tenant=who.key_tenant if who else "")  # fmt: skip
        response = await serve_proxied(
            request, op, self._open, lambda: self._forward(request, svc, target, prefix, op)
        )
        self.ctl.metrics.count_request(response.status)
        return response

    def _caller(self, request: web.Request, svc: ServiceRecord) -> auth.Principal | None:
        """The key a private service needs (see the module docstring); None for a public service, whose
        connections without a valid key are counted against the public services' caps (``public.py``;
        ``_Crowded`` when no room can be made)."""
        if svc.spec.public is True:
            self._admit_public(request, svc)
            return None
        key = auth.key_from_header(self.store, request.headers.get("Authorization"))
        mark_authenticated(request)
        request[auth.PRINCIPAL_KEY] = auth.Principal.of_key(key)
        tenant, org = auth.acting_tenant(self.store, key, request.headers.getall(auth.ORG_HEADER, []))
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
                auth.key_from_header(self.store, request.headers.get("Authorization"))
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
        check_length(request)
        head = request_head(request, prefix, keep_for_replica)
        has_body = request.body_exists
        problem: SandboxError | None = None
        for rep in replicas:
            port = self._port(svc, rep)
            if port is None:
                continue
            node = self.registry.get(rep.rec.node)
            if node is None or not node.healthy:
                continue
            sandbox = rep.rec.sandbox
            try:
                up = await self.pool.connect(sandbox, node.client, sandbox, port)
            except SandboxError as exc:
                up = None
                problem = exc
            if isinstance(up, Refusal):
                # The status alone: a public service's callers need no key, and the node's message names the
                # replica's sandbox (the owner reads it in the service's health, health.py).
                problem = BadGateway(f"the node refused the tunnel to the replica (HTTP {up.status})")
            if up is None or isinstance(up, Refusal):
                self.ctl.mark_down(sandbox)
                continue
            op.closers.append(up.close)
            timeout = answer_timeout_secs(svc.spec)
            dest = Destination(sandbox, sandbox, timeout, f"the replica did not begin its answer within {timeout:g} "
                               "s (the service's answer_timeout_secs)")  # fmt: skip
            try:
                response = await exchange(request, self.pool, up, target, head, dest, op)
            except NothingSent as exc:
                problem = BadGateway(f"a replica of {svc.name!r} did not take the request: {exc}")
                self.ctl.mark_down(sandbox)
                if has_body:
                    break
                continue
            self.ctl.mark_up(sandbox)
            return response
        raise problem or Unavailable(f"service {svc.name!r} has no reachable replica now; try again shortly")

    def _port(self, svc: ServiceRecord, rep: ReplicaRuntime) -> int | None:
        spec = self.ctl.db.revisions.get((svc.id, rep.rec.revision))
        port = spec.port if spec is not None else svc.spec.port
        return port if isinstance(port, int) else None

    # -- revocation -------------------------------------------------------------------------------------

    def end_service(self, service_id: str) -> None:
        """The owner lost access (or the service is gone): end its open requests."""
        self._end(lambda op: op.service_id == service_id,
                  Unavailable("this service's traffic was stopped: its owner holds no active key in its tenant"))  # fmt: skip

    async def access_changed(self) -> None:
        """End open requests whose key was revoked, lost ``sandbox:read``, or the membership it acted through."""
        store = self.store

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

    def _end(self, chosen: Callable[[_Open], bool], why: SandboxError) -> None:
        end_where(self._open, chosen, why)

    async def close(self) -> None:
        self.pool.close()
        self._end(lambda op: True, Unavailable("the gateway is stopping"))


class _Crowded(Exception):
    """No room for another connection without a key to a public service (see ``public.py``)."""
