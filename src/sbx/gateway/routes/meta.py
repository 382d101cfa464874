"""What the gateway itself answers: health, whoami, capabilities, and the refusals of what it does not serve
(``/v1/node*`` 404, ``/v1/images*`` 501, SSH 404 ``unsupported``, services, jobs, agent runs and secrets 501)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from sbx.api.errors import NotFound, Unavailable, Unsupported
from sbx.gateway.capabilities import intersect_capabilities
from sbx.gateway.http import principal_of
from sbx.node.http import json_response

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


class NoSsh(NotFound):
    """The gateway serves no SSH (404 with code ``unsupported``, as the spec's SSH endpoints say)."""

    code = "unsupported"


def routes(gw: Gateway) -> list[web.RouteDef]:
    """What the gateway answers itself and the refusals of what it does not serve."""

    async def health(request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def whoami(request: web.Request) -> web.Response:
        return json_response(principal_of(request).whoami())

    async def capabilities(request: web.Request) -> web.Response:
        caps = [n.status["capabilities"] for n in gw.registry.healthy()
                if n.status and isinstance(n.status.get("capabilities"), dict)]  # fmt: skip
        if not caps:
            raise Unavailable("no node is answering: the gateway cannot say what it offers now")
        return json_response(intersect_capabilities(caps))

    async def not_node(request: web.Request) -> web.Response:
        raise NotFound("a gateway does not serve /v1/node: use GET /v1/admin/nodes with an admin key")

    async def no_images(request: web.Request) -> web.Response:
        raise Unsupported("a gateway does not manage images: install them on each node with its images API")

    async def no_ssh(request: web.Request) -> web.Response:
        raise NoSsh("this gateway serves no SSH")

    async def later(request: web.Request) -> web.Response:
        raise Unsupported(f"this gateway does not serve {request.path.split('/')[2]} yet")

    table = [
        web.get("/v1/health", health),
        web.get("/v1/whoami", whoami),
        web.get("/v1/capabilities", capabilities),
        web.route("*", "/v1/node", not_node),
        web.route("*", "/v1/node/{tail:.*}", not_node),
        web.route("*", "/v1/images", no_images),
        web.route("*", "/v1/images/{tail:.*}", no_images),
        web.route("*", "/v1/ssh", no_ssh),
        web.route("*", "/v1/ssh-keys", no_ssh),
        web.route("*", "/v1/ssh-keys/{tail:.*}", no_ssh),
        web.route("*", "/v1/sandboxes/{ref}/ssh-access", no_ssh),
        web.route("*", "/v1/admin/ssh-keys", no_ssh),
        web.route("*", "/v1/admin/ssh-keys/{tail:.*}", no_ssh),
    ]
    for resource in ("services", "jobs", "agent-runs", "secrets"):
        table += [
            web.route("*", f"/v1/{resource}", later),
            web.route("*", f"/v1/{resource}/{{tail:.*}}", later),
        ]
    return table
