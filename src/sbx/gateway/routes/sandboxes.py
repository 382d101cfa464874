"""Handlers of the sandbox routes: create, list and delete through the ``Sandboxes`` service, PATCH with the
gateway's label and name rules, and every other call on one sandbox relayed to its node as the route table's
relay policy says, with the records kept in step with what the node did."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from msgspec import UNSET

from sbx.api.codec import decode_answer, decode_request, encode
from sbx.api.endpoints import Endpoint
from sbx.api.errors import InvalidRequest
from sbx.api.sandboxes import CreateRequest, PatchRequest, Sandbox, SandboxList
from sbx.api.snapshots import Snapshot
from sbx.gateway import auth
from sbx.gateway.http import ROUTE_SCOPES, label_of, principal_of, relayed_path
from sbx.gateway.labels import patch_request
from sbx.gateway.relay import Body, CappedBody, forward, guarded, relay_upgrade, relay_websocket
from sbx.gateway.revocation import OpenRequest
from sbx.gateway.state import SandboxRecord
from sbx.web.http import FILE_BODY_CAP, json_response, read_json_body
from sbx.web.websocket import check_websocket

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway

#: What a relay does after a 2xx answer of its node (keeps the gateway's records in step).
After = Callable[[web.Request, auth.Principal, SandboxRecord, web.Response], Awaitable[None]]


class SandboxRoutes:
    """``/v1/sandboxes`` and everything under ``/v1/sandboxes/{ref}``."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def create(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        req = decode_request(await read_json_body(request), CreateRequest)
        sandbox, _ = await self.gw.sandboxes.create(principal, req)
        request[auth.TARGET_KEY] = sandbox.id
        return json_response(sandbox, status=201)

    async def list(self, request: web.Request) -> web.Response:
        labels = []
        for item in request.query.getall("label", []):
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise InvalidRequest(f"label filter {item!r} must be key=value")
            labels.append((key, value))
        return json_response(SandboxList(await self.gw.sandboxes.list(principal_of(request), labels)))

    async def patch(self, request: web.Request) -> web.StreamResponse:
        principal = principal_of(request)
        rec = await self._target(request)
        req = decode_request(await read_json_body(request), PatchRequest)
        stamped: dict[str, str] = {}
        if req.labels is not UNSET:  # the gateway's own labels beyond owner and tenant are kept as they are
            current = await self.gw.node_for(rec.node, f"sandbox {rec.id}").client.sandbox(rec.id)
            stamped = {k: v for k, v in current.labels.items() if k.startswith("gateway.")}
        # A rename runs one at a time with its owner's creates and other renames (with replicas, across all of
        # them), so two cannot take one name together.
        names = (
            [self.gw.name_lock("sandbox", principal.user, principal.tenant)] if req.name is not UNSET else []
        )
        if req.network is not UNSET:  # a network change needs the guest: a persistent one asleep is woken
            await self.gw.wakes.wake(rec)
        async with self.gw.reservation(*names):
            body = encode(patch_request(self.gw.sandboxes, principal, rec, req, stamped))
            response = await self._relay(request, principal, rec, body)
            if isinstance(response, web.Response) and response.status < 300 and response.body:
                answer = decode_answer(bytes(response.body), Sandbox, "Sandbox")  # type: ignore[arg-type]
                if (answer.name or None) != rec.name:
                    await self.gw.write(
                        self.gw.store.put_sandbox, dataclasses.replace(rec, name=answer.name or None)
                    )
        return response

    def relay(
        self, endpoint: Endpoint, policy: str, after: After | None = None, wakes: bool = False
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """The handler passing a call on one sandbox to its node: without a body (``none``), with a JSON body
        (``json``) or a streamed one (``raw``); switched to a raw stream where ``endpoint`` upgrades. Where the
        call ``wakes`` a persistent sandbox asleep, the tenant's quota is checked and the sandbox woken first
        (``sbx.gateway.persistent``)."""

        async def handler(request: web.Request) -> web.StreamResponse:
            principal = principal_of(request)
            rec = await self._target(request)
            if wakes:
                await self.gw.wakes.wake(rec)
            body: Body = None
            if policy == "raw":
                body = CappedBody(request, FILE_BODY_CAP)
            elif policy == "json":
                body = await read_json_body(request)
            return await self._pass_on(request, principal, rec, body, endpoint.upgrade, after)

        return handler

    async def _pass_on(
        self, request: web.Request, principal: auth.Principal, rec: SandboxRecord, body: Body,
        upgrade: str | None, after: After | None,
    ) -> web.StreamResponse:  # fmt: skip
        response = await self._relay(request, principal, rec, body, upgrade)
        if after is not None and isinstance(response, web.Response) and response.status < 300:
            await after(request, principal, rec, response)
        return response

    async def attach_websocket(self, request: web.Request) -> web.StreamResponse:
        """The WebSocket form of attach, served here over the node's plain attach (``relay_websocket``)."""
        principal = principal_of(request)
        rec = await self._target(request)
        check_websocket(request)
        await self.gw.wakes.wake(rec)
        node = self.gw.node_for(rec.node, f"sandbox {rec.id}").client
        attach_path = relayed_path(request, rec.id).split("?", 1)[0].removesuffix("/websocket")
        op = self._open_request(request, principal, rec, node.name)
        return await guarded(request, op, self.gw.open, relay_websocket(request, node, attach_path, op))

    def _open_request(
        self, request: web.Request, principal: auth.Principal, rec: SandboxRecord, node: str
    ) -> OpenRequest:
        return OpenRequest(
            key_id=principal.key_id or "", user=principal.user, key_tenant=principal.key_tenant,
            tenant=principal.tenant, scopes=request.get(ROUTE_SCOPES, ()), route=f"{request.method} {label_of(request)}",
            sandbox=rec.id, node=node,
        )  # fmt: skip

    async def _target(self, request: web.Request) -> SandboxRecord:
        rec = await self.gw.sandboxes.find(principal_of(request), request.match_info["ref"])
        request[auth.TARGET_KEY] = rec.id
        return rec

    async def _relay(
        self, request: web.Request, principal: auth.Principal, rec: SandboxRecord, body: Body,
        upgrade: str | None = None,
    ) -> web.StreamResponse:  # fmt: skip
        node = self.gw.node_for(rec.node, f"sandbox {rec.id}").client
        # The node is asked by id, never by the name the caller used, on the path exactly as the client sent it.
        target = relayed_path(request, rec.id)
        op = self._open_request(request, principal, rec, node.name)
        if upgrade is not None and _asks_upgrade(request, upgrade):
            return await guarded(request, op, self.gw.open, relay_upgrade(request, node, target, upgrade, op))
        return await guarded(
            request, op, self.gw.open, forward(request, node, request.method, target, body, op)
        )

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """``POST .../resume``: a persistent sandbox asleep is woken here, once its tenant's quota has room for its
        cpus and memory (403 otherwise, the node asked nothing); any other is relayed to its node as it is."""
        principal = principal_of(request)
        rec = await self._target(request)
        body = await read_json_body(request)
        woke = await self.gw.wakes.wake(rec)
        if woke is not None:
            return json_response(woke)
        return await self._pass_on(request, principal, rec, body, None, self.learnt)

    # -- what the records learn from a node's answer -------------------------------------------------------

    async def learnt(
        self, request: web.Request, principal: auth.Principal, rec: SandboxRecord, response: web.Response
    ) -> None:
        """A sandbox's state as its node answered (GET, suspend, resume, stop): whether it is asleep."""
        if response.body:
            answer = decode_answer(bytes(response.body), Sandbox, "Sandbox")  # type: ignore[arg-type]
            await self.gw.wakes.learnt(rec, answer)

    async def deleted(
        self, request: web.Request, principal: auth.Principal, rec: SandboxRecord, response: web.Response
    ) -> None:
        await self.gw.sandboxes.terminated(rec)

    async def snapshot_taken(
        self, request: web.Request, principal: auth.Principal, rec: SandboxRecord, response: web.Response
    ) -> None:
        if response.body:
            snap = decode_answer(bytes(response.body), Snapshot, "Snapshot")  # type: ignore[arg-type]
            await self.gw.snapshots.taken(rec.user, rec.tenant, rec.node, rec.id, snap)


def _asks_upgrade(request: web.Request, protocol: str) -> bool:
    """Whether the client asks to switch to ``protocol`` (otherwise the node answers the plain GET: 400)."""
    connection = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
    return "upgrade" in connection and request.headers.get("Upgrade", "").strip().lower() == protocol
