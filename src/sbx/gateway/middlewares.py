"""The gateway's request pipeline, outermost first: ``record`` (audit line and request metric, after the answer
is known), ``error_middleware`` (every failure becomes the error body), ``authenticate`` (Origin, key,
``X-Sandbox-Org``, then the scope the route table names, in the spec's order, before any handler looks anything
up). A request no route matches is answered 404 once its key is known good: no path is open by omission, but for
the web console's static assets under ``/console`` (after the Origin check; ``sbx.web.console``).

With replicas, a read carrying a credential first waits until this replica's memory holds every write committed
before it (``Gateway.up_to_date``: read-your-writes across replicas, docs/ha.md), before its key is even looked
up, so a key revoked or made through another replica counts too; the one place every read endpoint goes through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from sbx.gateway import auth
from sbx.gateway.http import ROUTE_LABEL, ROUTE_SCOPES, UNMATCHED, label_of
from sbx.gateway.routes import route_of
from sbx.web import websocket
from sbx.web.connections import mark_authenticated
from sbx.web.console import PREFIX as CONSOLE_PREFIX
from sbx.web.console import is_console_path
from sbx.web.http import Handler, error_middleware

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway

#: The methods that only read: answered from memory once it holds every write made before them.
READS = frozenset({"GET", "HEAD"})


def preflight(origin: str) -> web.Response:
    """A CORS preflight: no key is sent with one; the Origin check already passed."""
    return web.Response(status=204, headers={
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": "GET, POST, PUT, PATCH, DELETE",
        "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Sandbox-Org",
        "Access-Control-Max-Age": "600",
    })  # fmt: skip


def install_cors(app: web.Application, gw: Gateway) -> None:
    """Every answer to an allowed Origin says so (``Access-Control-Allow-Origin``), errors too, so a browser can read
    why a call failed; set as the answer is prepared, so streamed ones (a file download, followed output, a relayed
    node answer), whose headers go out before the handler returns, say it as well."""

    async def allow(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and origin in gw.options.cors_origins:
            response.headers["Access-Control-Allow-Origin"] = origin

    app.on_response_prepare.append(allow)


def make_middlewares(gw: Gateway, *fronts: Any) -> list[Any]:
    """The pipeline; ``fronts`` (the services' and the exposed ports' traffic fronts) run after the error
    middleware and before authentication: each answers what it recognises by itself (its own credentials, no
    Origin check) and passes the rest on."""

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            label = label_of(request)
            gw.metrics.count_request(label, status)
            principal = request.get(auth.PRINCIPAL_KEY)
            if isinstance(principal, auth.Principal):
                gw.record_audit(kind="api", type="api.request", key_id=principal.key_id, user=principal.user,
                                tenant=principal.tenant or None, org=principal.org, method=request.method,
                                route=label, status=status, target=request.get(auth.TARGET_KEY))  # fmt: skip

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        row = route_of(request)
        request[ROUTE_LABEL] = row.label if row is not None else UNMATCHED
        origin = request.headers.get("Origin")
        auth.check_origin(origin, request.headers.get("Host", ""), gw.options.cors_origins)
        if request.method == "OPTIONS" and origin is not None:
            return preflight(origin)
        resource = request.match_info.route.resource
        if row is None and resource is not None and is_console_path(resource.canonical):
            request[ROUTE_LABEL] = CONSOLE_PREFIX
            return await handler(request)  # the web console's assets: no secret, no key (it signs in itself)
        if row is not None and row.scope is None:
            return await handler(request)  # no credential (GET /v1/health)
        # A WebSocket route may carry the key (and the organisation) as offered subprotocols (sbx.web.websocket).
        authorization = websocket.authorization(request)
        if request.method in READS and authorization is not None:
            # Whatever it shows, and the key itself, as of every write acknowledged before it (docs/ha.md).
            await gw.up_to_date()
        elif auth.names_unknown_key(gw.store, authorization):
            # A key made through another replica a moment ago may not have arrived yet: wait for what was
            # committed before this request, then look (docs/ha.md).
            await gw.caught_up()
        key = auth.key_from_header(gw.store, authorization)
        mark_authenticated(request)
        # Known before the organisation is checked, so a refused X-Sandbox-Org still leaves an audit line.
        request[auth.PRINCIPAL_KEY] = auth.Principal.of_key(key)
        orgs = request.headers.getall(auth.ORG_HEADER, []) + websocket.offered_orgs(request)
        tenant, org = auth.acting_tenant(gw.store, key, orgs)
        principal = auth.Principal.of_key(key, tenant, org)
        request[auth.PRINCIPAL_KEY] = principal
        if row is None:
            exc = request.match_info.http_exception
            raise exc if exc is not None else web.HTTPNotFound()
        request[ROUTE_SCOPES] = row.scope or ()
        auth.check_scopes(principal, row.scope or ())
        return await handler(request)

    return [record, error_middleware, *fronts, authenticate]
