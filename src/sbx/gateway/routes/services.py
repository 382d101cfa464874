"""Handlers of ``/v1/services``: a service belongs to the user and tenant that made it, its name to the tenant
(spec: Services); an admin names another tenant's with ``?tenant=``. The work is the controller's
(``sbx.gateway.services``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from sbx.api.codec import decode_request
from sbx.api.services import ScaleRequest, ServiceList, ServiceSpec
from sbx.gateway import auth, specs
from sbx.gateway.http import principal_of
from sbx.gateway.services.spec import check_replicas, check_spec
from sbx.gateway.services.store import ServiceRecord
from sbx.web.http import json_response, read_json_body

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


class ServiceRoutes:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def _answer(self, request: web.Request, svc: ServiceRecord, status: int = 200) -> web.Response:
        request[auth.TARGET_KEY] = svc.name
        return json_response(
            self.gw.services.wire(svc, self.gw.service_front.url(svc, request)), status=status
        )

    def _checked(self, tenant: str, spec: ServiceSpec) -> ServiceSpec:
        """``spec`` checked against what the nodes offer now and the tenant's secrets, and completed."""
        return check_spec(specs.offered_by(self.gw.registry), self.gw.secrets, tenant, spec)

    async def _target(self, request: web.Request) -> ServiceRecord:
        principal, name, tenant = (
            principal_of(request),
            request.match_info["name"],
            request.query.get("tenant"),
        )
        return await self.gw.fresh(lambda: self.gw.services.find(principal, name, tenant))

    async def create(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        spec = decode_request(await read_json_body(request), ServiceSpec)
        svc = await self.gw.services.create(principal, self._checked(principal.tenant, spec))
        return self._answer(request, svc, 201)

    async def list(self, request: web.Request) -> web.Response:
        services = self.gw.services.listing(principal_of(request))
        front = self.gw.service_front
        return json_response(ServiceList([self.gw.services.wire(s, front.url(s, request)) for s in services]))

    async def get(self, request: web.Request) -> web.Response:
        return self._answer(request, await self._target(request))

    async def put(self, request: web.Request) -> web.Response:
        svc = await self._target(request)
        spec = decode_request(await read_json_body(request), ServiceSpec)
        return self._answer(request, await self.gw.services.update(svc, self._checked(svc.tenant, spec)))

    async def scale(self, request: web.Request) -> web.Response:
        svc = await self._target(request)
        req = decode_request(await read_json_body(request), ScaleRequest)
        return self._answer(request, await self.gw.services.scale(svc, check_replicas(req.replicas)))

    async def delete(self, request: web.Request) -> web.Response:
        svc = await self._target(request)
        request[auth.TARGET_KEY] = svc.name
        await self.gw.services.delete(svc)
        return web.Response(status=204)
