"""The exposed ports' traffic front (issue 33, docs/ports.md): HTTP and upgrades (WebSocket) to a sandbox's port
on ``<label>.<--ports-domain>``, through its node's tunnel, on the gateway's own listener.

Who may call (in this order): a URL carrying a port token (``?sbx_port_token=sgp_...``) trades it for a cookie of
this one host and is redirected to itself without the token (303, ``Referrer-Policy: no-referrer``); the guest never
sees that request. A public port takes anyone (connections without a key counted against the public caps,
``services/public.py``: ``--max-public-connections`` in all, ``--max-public-connections-per-sandbox`` per sandbox).
A private one takes the owner's key (or an admin's) with ``sandbox:read`` as ``Authorization: Bearer`` (another
user's key: 404, as for no such sandbox), or the cookie of a token of this sandbox's port; nothing else (401). A
token stops opening anything once its key is revoked or loses its user's access, or the sandbox ended; open
requests and WebSockets made with it end then too (``access_changed``).

What reaches the guest: the request as sent, with ``X-Forwarded-For/Host/Proto``, without the gateway's key, the
port token or the port cookie however spelled (``credentials``: one parse decides what authenticates and what is
dropped) and without ``X-Sandbox-Org``. The shared machinery (keep-alive pool, upgrades, answer timeout, body
cap) is ``proxying``.

Answers of the gateway itself: 404 for a host naming no sandbox (or one that ended), 409 for a sandbox suspended
and not persistent, 502 when nothing listens on the port, 504 when the guest did not begin its answer within
:data:`ANSWER_TIMEOUT_SECS`. A persistent sandbox asleep is woken first (``Wakes.wake``: the quota is checked as
for any wake) and the request held until its port takes the connection, for :data:`WAKE_WAIT_SECS` at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from sbx.api.errors import BadGateway, Conflict, NotFound, Unauthorized, Unavailable, error_from_answer
from sbx.gateway import auth
from sbx.gateway.http import ROUTE_LABEL
from sbx.gateway.keys import hash_secret
from sbx.gateway.nodeclient import NodeClient, Refusal
from sbx.gateway.ports import credentials
from sbx.gateway.ports.labels import label_for, parse_label
from sbx.gateway.ports.store import PortStore, PortTokenRecord
from sbx.gateway.proxying import (
    Destination,
    NothingSent,
    Proxied,
    Upstream,
    UpstreamPool,
    check_length,
    end_where,
    exchange,
    request_head,
    serve_proxied,
)
from sbx.gateway.services.public import PublicConnections
from sbx.gateway.state import SandboxRecord
from sbx.net.loopback import host_header_name
from sbx.web.connections import anonymous_connection, mark_authenticated
from sbx.web.http import Handler, error_response

if TYPE_CHECKING:
    from sbx.gateway.interfaces import AuditSink, Freshness, Leadership, NodeLookup
    from sbx.gateway.ports.interfaces import Wakes
    from sbx.gateway.store.base import Store

log = logging.getLogger(__name__)

#: The route label of port traffic in metrics and the audit log (never a sandbox id or a port).
ROUTE = "{port}.{ports-domain}"
#: Seconds a guest has to take each part of a request and begin its answer (as a service's default).
ANSWER_TIMEOUT_SECS = 120.0
#: Seconds a request to a sandbox just woken (or waking at its node) waits for its port to take a connection.
WAKE_WAIT_SECS = 30.0
WAKE_RETRY_SECS = 0.25
#: Seconds a kept-alive connection to a guest's port stays open idle: its tunnel keeps the sandbox from its idle
#: timeout, so a sandbox idles out at most this long after its timeout once the last request ended.
IDLE_SECS = 5.0
#: Connections without a key to one sandbox's public ports, at most, by default (under the node's 128
#: tunnels per sandbox, so the crowd of one public port leaves room for its owner).
DEFAULT_MAX_PER_SANDBOX = 64


@dataclass(eq=False)
class _Open(Proxied):
    """A request being proxied to a port: whose (a key's, or a token's key), to which sandbox."""

    sandbox: str = ""
    key_id: str | None = None
    user: str = ""
    tenant: str = ""


@dataclass(frozen=True)
class _Caller:
    key_id: str
    user: str
    tenant: str


def keep_for_guest(lowered: str, value: str) -> str | None:
    """What of a request header reaches the guest: never the gateway's key, a port token or the port cookie,
    however spelled, nor ``X-Sandbox-Org``; other cookies and authorizations as sent."""
    if lowered == "authorization" and (
        auth.carries_gateway_key(value) or credentials.carries_credential(value)
    ):
        return None
    if lowered == auth.ORG_HEADER.lower():
        return None
    if lowered == "cookie":
        _, rest = credentials.split_cookies(value)
        return rest or None
    return value


class PortFront:
    """The middleware that answers port traffic, and what it keeps (connections, open requests).

    Given the store (sandbox records, keys, memberships), its look-ups that catch up with other replicas, the
    nodes holding the sandboxes, the wakes of persistent ones, the audit log and whether this replica leads (asked
    each time: it changes); never the gateway."""

    def __init__(
        self, store: Store, db: PortStore, domain: str, public: PublicConnections,
        per_sandbox: int = DEFAULT_MAX_PER_SANDBOX, *, fresh: Freshness, nodes: NodeLookup, wakes: Wakes,
        audit: AuditSink, leadership: Leadership,
    ) -> None:  # fmt: skip
        self.store = store
        self.fresh = fresh
        self.nodes = nodes
        self.wakes = wakes
        self.audit = audit
        self.leadership = leadership
        self.db = db
        self.domain = domain.lower().strip(".")
        self._domain_host = host_header_name(self.domain)
        self.public = public
        self.per_sandbox = per_sandbox
        self.pool = UpstreamPool(IDLE_SECS)
        self._open: set[_Open] = set()

    # -- addresses --------------------------------------------------------------------------------------

    def url(self, sandbox_id: str, port: int, scheme: str) -> str:
        label = label_for(sandbox_id, port)
        if label is None:
            raise Conflict(f"sandbox {sandbox_id} has an id no port URL can name (made by an older node)")
        return f"{scheme}://{label}.{self.domain}/"

    def _match(self, request: web.Request) -> str | None:
        """The label of a request to ``<label>.<domain>`` (by ``Host`` alone: ``X-Forwarded-Host`` is the
        client's to write, so never routes)."""
        host = host_header_name(request.headers.get("Host", ""))
        suffix = "." + self._domain_host
        if self._domain_host and host.endswith(suffix) and "." not in host[: -len(suffix)]:
            return host[: -len(suffix)]
        return None

    # -- the middleware ---------------------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        label = self._match(request)
        if label is None:
            return await handler(request)
        request[ROUTE_LABEL] = ROUTE
        parsed = parse_label(label)
        if parsed is None:
            raise NotFound(f"no port {label!r} here: a port's host is <port>-<sandbox id without sbx_, _ as ->."
                           f"{self.domain}, as GET /v1/sandboxes/ID/ports answers it")  # fmt: skip
        sandbox_id, port = parsed
        rec = await self.fresh.fresh(lambda: self._record(sandbox_id))
        # Who may open it (its public flag, a token, a cookie's token, a key) as of every write acknowledged before
        # this request, through any replica (docs/ha.md): a port made public or private, or a token made, a moment
        # ago through another replica counts here at once. Best effort: while the database is out of reach no
        # write can be acknowledged, so memory is then what any replica would answer from.
        await self.fresh.caught_up()
        tokens, rest = credentials.split_query(request.rel_url.raw_query_string)
        if tokens:
            return await self._trade(request, rec, port, tokens, rest)
        try:
            who = self._caller(request, rec, port)
        except _Crowded:
            refusal = error_response(Unavailable(
                f"too many connections without a key to the public ports of sandbox {rec.id} (or to the "
                "gateway's public services and ports) are busy now: try again shortly"
            ), close=True)  # fmt: skip
            refusal.headers["Retry-After"] = "1"
            return refusal
        op = _Open(sandbox=rec.id, key_id=who.key_id if who else None, user=who.user if who else "",
                   tenant=who.tenant if who else "")  # fmt: skip
        raw = request.rel_url.raw_path + (f"?{rest}" if rest else "")
        return await serve_proxied(
            request, op, self._open, lambda: self._forward(request, rec, port, raw, op)
        )

    def _record(self, sandbox_id: str) -> SandboxRecord:
        rec = self.store.sandboxes.get(sandbox_id)
        if rec is None:
            raise NotFound(f"no sandbox {sandbox_id} here: it ended, or never was")
        return rec

    def _caller(self, request: web.Request, rec: SandboxRecord, port: int) -> _Caller | None:
        """Who opens the port (see the module docstring): None for a public one; ``_Crowded`` when its caps
        leave no room; 401 or 404 otherwise."""
        authorization = request.headers.get("Authorization")
        secret = auth.bearer_credential(authorization)
        if self.db.is_public(rec.id, port):
            self._admit_public(request, rec, authorization)
            return None
        if secret is not None and secret.startswith("sgk_"):
            key = auth.key_from_header(self.store, authorization)
            mark_authenticated(request)
            request[auth.PRINCIPAL_KEY] = auth.Principal.of_key(key)
            tenant, org = auth.acting_tenant(self.store, key, request.headers.getall(auth.ORG_HEADER, []))
            principal = auth.Principal.of_key(key, tenant, org)
            request[auth.PRINCIPAL_KEY] = principal
            if not principal.owns(rec.user, rec.tenant):
                raise NotFound(f"no sandbox {rec.id} among yours")
            auth.check_scopes(principal, ("sandbox:read",))
            request[auth.TARGET_KEY] = rec.id
            assert key.id is not None
            return _Caller(key.id, principal.user, principal.tenant)
        cookies = [v for h in request.headers.getall("Cookie", []) for v in credentials.split_cookies(h)[0]]
        now = time.time()
        for value in cookies:
            token = self._good_token(value, rec.id, port, now)
            if token is not None:
                mark_authenticated(request)
                return _Caller(token.key_id, token.user, token.tenant)
        if cookies:
            raise Unauthorized(
                f"this port's cookie has expired or its key was revoked: open a new token URL (POST "
                f"/v1/sandboxes/{rec.id}/ports/{port}/tokens)"
            )
        raise Unauthorized(
            f"port {port} of sandbox {rec.id} is private: send Authorization: Bearer sgk_... of its owner, or open a "
            f"token URL (POST /v1/sandboxes/{rec.id}/ports/{port}/tokens); or make it public (PUT "
            f'/v1/sandboxes/{rec.id}/ports/{port} {{"public": true}})'
        )

    def _admit_public(self, request: web.Request, rec: SandboxRecord, authorization: str | None) -> None:
        conn = anonymous_connection(request)
        if conn is None:
            return  # a unix socket, or a connection that authenticated already
        if authorization is not None:
            # A valid key takes the connection out of every count, as on the API; anything else is no key.
            with contextlib.suppress(Unauthorized):
                auth.key_from_header(self.store, authorization)
                mark_authenticated(request)
                return
        if not self.public.admit(conn, rec.id, self.per_sandbox):
            raise _Crowded

    def _good_token(self, secret: str, sandbox: str, port: int, now: float) -> PortTokenRecord | None:
        """The token ``secret`` names when it opens ``port`` of ``sandbox`` now: unexpired, its key still
        active and its user still reaching the tenant."""
        token = (
            self.db.tokens.get(hash_secret(secret)) if secret.startswith(credentials.TOKEN_PREFIX) else None
        )
        if token is None or not token.opens(sandbox, port, now):
            return None
        return token if self._still_good(token) else None

    def _still_good(self, token: PortTokenRecord) -> bool:
        store = self.store
        return auth.is_key_still_good(store, token.key_id, ()) and auth.has_access(
            store, token.user, token.tenant
        )

    async def _trade(
        self, request: web.Request, rec: SandboxRecord, port: int, tokens: list[str], rest: str
    ) -> web.StreamResponse:
        """A token URL opened: a cookie of this host for the token, and the same URL without it."""
        now = time.time()
        token = next((t for s in tokens if (t := self._good_token(s, rec.id, port, now)) is not None), None)
        if token is None:
            raise Unauthorized(
                f"this port token is unknown, expired or revoked, or opens another port: ask for a new one (POST "
                f"/v1/sandboxes/{rec.id}/ports/{port}/tokens)"
            )
        mark_authenticated(request)
        secret = next(s for s in tokens if hash_secret(s) == token.token_sha256)
        location = request.rel_url.raw_path + (f"?{rest}" if rest else "")
        response = web.Response(status=303, headers={
            "Location": location,
            "Set-Cookie": credentials.set_cookie_header(request.scheme, secret, int(token.expires_at - now)),
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store",
        })  # fmt: skip
        self.audit.record_audit(kind="api", type="port.token_traded", key_id=token.key_id, user=token.user,
                                tenant=token.tenant or None, method=request.method, route=ROUTE, status=303,
                                target=rec.id, port=port)  # fmt: skip
        return response

    # -- forwarding -------------------------------------------------------------------------------------

    async def _forward(
        self, request: web.Request, rec: SandboxRecord, port: int, target: str, op: _Open
    ) -> web.StreamResponse:
        check_length(request)
        node = self.nodes.node_for(rec.node, f"sandbox {rec.id}")
        woken = await self.wakes.wake_from(rec) if rec.asleep else None
        # Booted from its disk: no server of before runs, so a refused connection is answered at once.
        woke, started = (
            woken is not None and woken[0] != "stopped",
            woken is not None and woken[0] == "stopped",
        )
        head = request_head(request, "", keep_for_guest)
        key = f"{rec.id}:{port}"
        dest = Destination(key, rec.id, ANSWER_TIMEOUT_SECS,
                           f"port {port} of sandbox {rec.id} did not begin its answer within "
                           f"{ANSWER_TIMEOUT_SECS:g} s")  # fmt: skip
        for attempt in range(2):
            up = await self._connect(node.client, rec, port, woke, started)
            op.closers.append(up.close)
            reused = up.idle_since != 0.0
            try:
                return await exchange(request, self.pool, up, target, head, dest, op)
            except NothingSent:
                # A kept-alive connection the guest closed meanwhile: once more on a new one, when nothing of
                # the request's body can have been taken.
                if attempt or not reused or request.body_exists:
                    raise BadGateway(
                        f"port {port} of sandbox {rec.id} closed the connection before answering"
                    ) from None
        raise AssertionError("unreachable")

    async def _connect(
        self, client: NodeClient, rec: SandboxRecord, port: int, woke: bool, started: bool = False
    ) -> Upstream:
        """A connection to the port; the node's refusal as the gateway's answer (see the module). A sandbox
        just woken (here or by its node) is given :data:`WAKE_WAIT_SECS` for its port to take it; one just
        ``started`` from its disk (it was stopped) runs none of its old processes, so a refusal is answered at
        once, saying so."""
        deadline = time.monotonic() + WAKE_WAIT_SECS
        while True:
            opened = await self.pool.connect(f"{rec.id}:{port}", client, rec.id, port)
            if not isinstance(opened, Refusal):
                return opened
            if opened.status == 404:
                raise NotFound(f"no sandbox {rec.id} here: it ended")
            if opened.status != 409:
                raise error_from_answer(opened.status, opened.body)
            if not woke:
                state = await client.sandbox(rec.id)
                if state.state == "terminated":
                    raise NotFound(f"no sandbox {rec.id} here: it ended")
                if state.state != "running" and not state.persistent:
                    raise Conflict(
                        f"sandbox {rec.id} is {state.state} and not persistent, so its ports answer nothing: resume "
                        f"it (POST /v1/sandboxes/{rec.id}/resume)"
                    )
            if started:
                raise BadGateway(
                    f"nothing listens on port {port} in sandbox {rec.id}: it was stopped, so it was started again "
                    "from its disk and none of its processes were kept; start the server on that port again"
                )
            if not woke or time.monotonic() >= deadline:
                raise BadGateway(
                    f"nothing listens on port {port} in sandbox {rec.id}: start a server there on that port "
                    "(on any address of the guest)"
                )
            await asyncio.sleep(WAKE_RETRY_SECS)

    # -- what ends open requests ------------------------------------------------------------------------

    async def access_changed(self) -> None:
        """End open requests whose key (or whose token's key) was revoked or lost its user's access, and forget
        the tokens and public flags of sandboxes the gateway no longer knows (the 30 s recheck too)."""
        store = self.store

        def bad(op: _Open) -> bool:
            if op.key_id is None:
                return False
            if not auth.is_key_still_good(store, op.key_id, ()):
                return True
            return not auth.has_access(store, op.user, op.tenant)

        end_where(
            self._open, bad,
            Unauthorized("this request was ended because its API key was revoked or lost the scope it needs"),
        )  # fmt: skip
        gone = {s for s, _ in list(self.db.public)} | {t.sandbox for t in list(self.db.tokens.values())}
        gone = {s for s in gone if s not in store.sandboxes}
        if self.leadership.leading:
            try:
                await self.db.forget(gone)
            except Exception:  # a sweep that fails is tried again at the next recheck
                log.exception("forgetting ended sandboxes' ports failed")

    async def ended(self, sandbox_id: str) -> None:
        """The sandbox was terminated through this gateway: its open requests end, its idle connections close,
        its public flags and tokens are forgotten."""
        end_where(self._open, lambda op: op.sandbox == sandbox_id,
                  NotFound(f"no sandbox {sandbox_id} here: it ended"))  # fmt: skip
        self.pool.drop(f"{sandbox_id}:")
        await self.db.forget({sandbox_id})

    async def close(self) -> None:
        self.pool.close()
        end_where(self._open, lambda op: True, Unavailable("the gateway is stopping"))


class _Crowded(Exception):
    """No room for another connection without a key to a sandbox's public ports (see ``public.py``)."""


__all__ = ["ANSWER_TIMEOUT_SECS", "DEFAULT_MAX_PER_SANDBOX", "ROUTE", "WAKE_WAIT_SECS", "PortFront",
           "keep_for_guest"]  # fmt: skip
