"""What the gateway answers itself: health, readiness, whoami, capabilities, and the refusals of what it does not serve
(``/v1/node`` 404, images 501; SSH without ``--ssh-listen`` is ``ssh.py``'s)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from aiohttp import web

from sbx.api.errors import NotFound, Unavailable, Unsupported
from sbx.api.gateway import Health, Readiness
from sbx.api.openapi import openapi_json
from sbx.gateway.capabilities import intersect_capabilities
from sbx.gateway.http import principal_of
from sbx.web.http import json_response

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


#: The store's part of the readiness check is asked at most this often (seconds); a flood of health checks in
#: between is answered from the last result.
READY_CACHE_SECS = 1.0


class MetaRoutes:
    """Health, readiness, whoami, capabilities, and the endpoints this gateway refuses."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._checked_at = -READY_CACHE_SECS
        self._not_ready: str | None = None
        #: The store's check under way: every request waiting meanwhile shares it.
        self._checking: asyncio.Future[str | None] | None = None

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=openapi_json(), content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        return json_response(Health("ok"))

    async def ready(self, request: web.Request) -> web.Response:
        """200 when this replica can serve; 503 with the reason otherwise (no credential, nothing secret)."""
        reason = "it is stopping" if self.gw.draining else await self._store_not_ready()
        if reason is not None:
            raise Unavailable(f"this gateway is not ready: {reason}")
        return json_response(Readiness("ready"))

    async def _store_not_ready(self) -> str | None:
        if time.monotonic() - self._checked_at < READY_CACHE_SECS:
            return self._not_ready
        if self._checking is None:
            self._checking = asyncio.ensure_future(asyncio.to_thread(self._check_store))

            def done(task: asyncio.Future[str | None]) -> None:
                self._checking = None
                self._checked_at = time.monotonic()
                self._not_ready = "its check was cut short" if task.cancelled() else task.result()

            self._checking.add_done_callback(done)
        # Shielded: a client going away does not cancel the check the others wait on.
        return await asyncio.shield(self._checking)

    def _check_store(self) -> str | None:
        try:
            return self.gw.store.not_ready()
        except Exception:  # a check that fails is a replica not known to serve
            log.exception("the readiness check failed")
            return "its readiness check failed"

    async def whoami(self, request: web.Request) -> web.Response:
        return json_response(principal_of(request).whoami())

    async def capabilities(self, request: web.Request) -> web.Response:
        caps = [n.status.capabilities for n in self.gw.registry.healthy() if n.status is not None]
        if not caps:
            raise Unavailable("no node is answering: the gateway cannot say what it offers now")
        return json_response(intersect_capabilities(caps, exposed_ports=self.gw.ports is not None))

    async def not_node(self, request: web.Request) -> web.Response:
        raise NotFound("a gateway does not serve /v1/node: use GET /v1/admin/nodes with an admin key")

    async def no_ports(self, request: web.Request) -> web.Response:
        raise Unsupported(
            "this gateway serves no port URLs (capability exposed_ports): start it with --ports-domain DOMAIN, a "
            "wildcard name *.DOMAIN that points at it"
        )

    async def no_images(self, request: web.Request) -> web.Response:
        raise Unsupported("a gateway does not manage images: install them on each node with its images API")
