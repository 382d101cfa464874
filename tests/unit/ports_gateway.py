"""A small gateway that answers the exposed-ports endpoints as docs/openapi.yaml describes them (issue 33), on a
unix socket in a thread of its own, for the SDK, CLI and MCP tests of the ports clients.

It checks what a real gateway checks (the owner's Bearer key, the port's range, ``public`` a boolean, ``ttl_secs``
1 to 86400, unknown fields) and answers with the error bodies of the API; ``serving=False`` answers every ports
endpoint 501 ``unsupported`` as a gateway without ``--ports-domain`` does."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from wire_samples import capabilities_body, sandbox_body

KEY = "sbxk_owner"
DOMAIN = "ports.test"
SANDBOX_ID = "sbx_0123456789abcdef"


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


@dataclass
class PortsGateway:
    """The state a test reads back: which ports are public, what each request carried."""

    serving: bool = True
    listening: set[int] = field(default_factory=lambda: {8000})
    public: set[int] = field(default_factory=set)
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    tokens: int = 0

    def url(self, port: int) -> str:
        return f"http://{port}-{SANDBOX_ID.removeprefix('sbx_')}.{DOMAIN}/"

    def port_body(self, port: int) -> dict[str, Any]:
        return {
            "port": port,
            "url": self.url(port),
            "public": port in self.public,
            "listening": port in self.listening,
        }

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/v1/capabilities", self.capabilities)
        app.router.add_get("/v1/sandboxes/{ref}", self.sandbox)
        app.router.add_get("/v1/sandboxes/{ref}/ports", self.list_ports)
        app.router.add_get("/v1/sandboxes/{ref}/ports/{port}", self.get_port)
        app.router.add_put("/v1/sandboxes/{ref}/ports/{port}", self.put_port)
        app.router.add_post("/v1/sandboxes/{ref}/ports/{port}/tokens", self.token)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.method, request.path, body))
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return _error(401, "unauthorized", "a valid API key is required (Authorization: Bearer <key>)")
        ref = request.match_info.get("ref")
        if ref is not None and ref not in (SANDBOX_ID, "web"):
            return _error(404, "not_found", f"no sandbox {ref!r}")
        if "/ports" in request.path and not self.serving:
            return _error(
                501, "unsupported", "exposed ports are off: start the gateway with --ports-domain DOMAIN"
            )
        response: web.StreamResponse = await handler(request)
        return response

    async def capabilities(self, request: web.Request) -> web.Response:
        return web.json_response(capabilities_body(exposed_ports=self.serving))

    async def sandbox(self, request: web.Request) -> web.Response:
        return web.json_response(sandbox_body(id=SANDBOX_ID, name="web"))

    async def list_ports(self, request: web.Request) -> web.Response:
        return web.json_response({"ports": [self.port_body(p) for p in sorted(self.listening | self.public)]})

    def _port(self, request: web.Request) -> int | web.Response:
        text = request.match_info["port"]
        if not text.isdigit() or not 1 <= int(text) <= 65535:
            return _error(400, "invalid_request", f"port {text!r}: give 1 to 65535")
        return int(text)

    async def get_port(self, request: web.Request) -> web.Response:
        port = self._port(request)
        return port if isinstance(port, web.Response) else web.json_response(self.port_body(port))

    async def put_port(self, request: web.Request) -> web.Response:
        port = self._port(request)
        if isinstance(port, web.Response):
            return port
        body = await request.json()
        if set(body) != {"public"} or not isinstance(body["public"], bool):
            return _error(400, "invalid_request", "public: expected `bool`")
        (self.public.add if body["public"] else self.public.discard)(port)
        return web.json_response(self.port_body(port))

    async def token(self, request: web.Request) -> web.Response:
        port = self._port(request)
        if isinstance(port, web.Response):
            return port
        body = await request.json()
        ttl = body.get("ttl_secs", 3600)
        if set(body) - {"ttl_secs"} or not isinstance(ttl, int) or not 1 <= ttl <= 86400:
            return _error(400, "invalid_request", "ttl_secs: expected `int` >= 1 and <= 86400")
        self.tokens += 1
        token = f"sbxp_{self.tokens}_{ttl}"
        answer = {
            "token": token,
            "url": f"{self.url(port)}?sbx_port_token={token}",
            "expires_at": "2030-01-01T00:00:00Z",
        }
        return web.json_response(answer, status=201)


@contextmanager
def serve(gateway: PortsGateway) -> Iterator[str]:
    """Serve ``gateway`` on a unix socket; yields its ``unix://`` URL."""
    directory = Path(tempfile.mkdtemp(prefix="sbxports", dir="/tmp"))
    socket_path = str(directory / "gw.sock")
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(gateway.app(), access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.UnixSite(runner, socket_path).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"unix://{socket_path}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        shutil.rmtree(directory, ignore_errors=True)
