"""The gateway's request pipeline, outermost first: ``record`` (audit line and request metric, after the answer
is known), ``error_middleware`` (the node's: every failure becomes the error body), ``authenticate`` (Origin, key,
``X-Sandbox-Org``, scope, in the spec's order, before any handler looks anything up). Handlers then resolve what
the caller owns and relay to its node; later route modules (services, jobs, secrets, SSH) read
``request[auth.PRINCIPAL_KEY]`` the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from sbx.gateway import auth
from sbx.gateway.http import shape_of
from sbx.node.http import Handler, error_middleware

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


#: Sandbox sub-routes kept as their own metric label; any other tail is counted under the route's pattern, so
#: made-up paths cannot grow the label set.
_SUBROUTE_TAILS = (
    "run", "processes", "processes/{pid}", "processes/{pid}/output", "processes/{pid}/stdin",
    "processes/{pid}/signal", "processes/{pid}/attach", "tunnel", "files", "dirs", "events", "metrics",
    "suspend", "resume", "snapshots", "snapshot-schedule", "ssh-access",
)  # fmt: skip
SANDBOX_SUBROUTES = frozenset("/v1/sandboxes/{ref}/" + tail for tail in _SUBROUTE_TAILS)


def metric_route(request: web.Request, shape: str) -> str:
    """A bounded route label: the path shape for known routes, else the matched pattern, else ``unmatched``."""
    resource = request.match_info.route.resource
    if resource is None:
        return "unmatched"
    canonical = resource.canonical
    if "{tail}" not in canonical or shape in SANDBOX_SUBROUTES:
        return shape
    return canonical


def preflight(origin: str) -> web.Response:
    """A CORS preflight: no key is sent with one; the Origin check already passed."""
    return web.Response(status=204, headers={
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": "GET, POST, PUT, PATCH, DELETE",
        "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Sandbox-Org",
        "Access-Control-Max-Age": "600",
    })  # fmt: skip


def make_middlewares(gw: Gateway) -> list[Any]:
    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            response = await handler(request)
            status = response.status
            origin = request.headers.get("Origin")
            if origin is not None and origin in gw.options.cors_origins and not response.prepared:
                # Errors too, so a browser console can read why a call failed.
                response.headers["Access-Control-Allow-Origin"] = origin
            return response
        finally:
            route = shape_of(request)
            gw.metrics.count_request(metric_route(request, route), status)
            principal = request.get(auth.PRINCIPAL_KEY)
            if isinstance(principal, auth.Principal):
                gw.record_audit(kind="api", type="api.request", key_id=principal.key.id, user=principal.user,
                                tenant=principal.tenant or None, org=principal.org, method=request.method,
                                route=route, status=status, target=request.get(auth.TARGET_KEY))  # fmt: skip

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        auth.check_origin(
            request.headers.get("Origin"), request.headers.get("Host", ""), gw.options.cors_origins
        )
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and origin is not None:
            return preflight(origin)
        if request.method == "GET" and request.path == "/v1/health":
            return await handler(request)
        key = auth.key_from_header(gw.store, request.headers.get("Authorization"))
        tenant, org = auth.acting_tenant(gw.store, key, request.headers.getall(auth.ORG_HEADER, []))
        request[auth.PRINCIPAL_KEY] = auth.Principal(key, tenant, org)
        needed = auth.scopes_for(request.method, request.path)
        request[auth.SCOPES_KEY] = needed
        auth.check_scopes(key, needed)
        return await handler(request)

    return [record, error_middleware, authenticate]
