"""Request helpers every gateway handler uses: who is calling, the path's shape, the path with its query."""

from __future__ import annotations

from aiohttp import web

from sbx.gateway import auth


def route_shape(path: str) -> str:
    """The path with ids and names replaced by placeholders, for metrics and the audit log."""
    parts = path.split("/")
    shaped: list[str] = []
    for i, part in enumerate(parts):
        prev = parts[i - 1] if i > 0 else ""
        if prev in ("sandboxes", "volumes", "snapshots", "keys", "nodes", "members", "ssh-keys", "secrets",
                    "services", "jobs", "runs", "orgs") and i >= 3:  # fmt: skip
            shaped.append("{id}" if prev != "sandboxes" else "{ref}")
        elif prev == "processes" and i >= 5:
            shaped.append("{pid}")
        else:
            shaped.append(part)
    return "/".join(shaped)


def principal_of(request: web.Request) -> auth.Principal:
    """The caller, as ``authenticate`` set it (every route but ``GET /v1/health`` runs after it)."""
    principal = request.get(auth.PRINCIPAL_KEY)
    assert isinstance(principal, auth.Principal)
    return principal


def shape_of(request: web.Request) -> str:
    """``route_shape`` of the request's path, computed once per request."""
    shape = request.get(auth.ROUTE_KEY)
    if shape is None:
        shape = request[auth.ROUTE_KEY] = route_shape(request.path)
    return shape


def path_qs(request: web.Request, path: str) -> str:
    """``path`` with the request's query string, as relayed to a node."""
    return path + ("?" + request.query_string if request.query_string else "")
