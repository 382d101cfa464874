"""Request helpers every gateway handler uses: who is calling, what the route table said of the route, and the
path with its query."""

from __future__ import annotations

from aiohttp import web

from sbx.gateway import auth

#: The scopes the route needs (the revocation recheck holds an open request to them).
ROUTE_SCOPES: web.RequestKey[tuple[str, ...]] = web.RequestKey("route_scopes", tuple)
#: The route's label: its path pattern (``/v1/sandboxes/{ref}/run``), for metrics and the audit log.
ROUTE_LABEL: web.RequestKey[str] = web.RequestKey("route_label", str)
#: The label of a request no route matches: made-up paths never grow the label set.
UNMATCHED = "unmatched"


def principal_of(request: web.Request) -> auth.Principal:
    """The caller, as ``authenticate`` set it (every route but ``GET /v1/health`` runs after it)."""
    principal = request.get(auth.PRINCIPAL_KEY)
    assert isinstance(principal, auth.Principal)
    return principal


def label_of(request: web.Request) -> str:
    """The route's label, or ``unmatched``."""
    label: str = request.get(ROUTE_LABEL, UNMATCHED)
    return label


def path_qs(request: web.Request, path: str) -> str:
    """``path`` (percent-encoded, as sent on the wire) with the request's query string as the client sent it."""
    query = request.rel_url.raw_query_string
    return path + ("?" + query if query else "")


def relayed_path(request: web.Request, sandbox_id: str | None = None) -> str:
    """The path a node is asked, percent-encoded exactly as the client sent it (never decoded: an encoded ``?``,
    ``/`` or ``..`` in a segment must stay inside that segment), with the ``{ref}`` segment of a sandbox route
    replaced by the sandbox's id (the node is always asked by id), and the query string."""
    segments = request.rel_url.raw_path.split("/")
    if sandbox_id is not None:
        assert segments[1:3] == ["v1", "sandboxes"] and len(segments) > 3
        segments[3] = sandbox_id
    return path_qs(request, "/".join(segments))
