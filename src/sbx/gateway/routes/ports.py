"""``/v1/sandboxes/{ref}/ports*`` (capability ``exposed_ports``, docs/ports.md): a sandbox's ports, making one
public or private, and port tokens. Served only with ``--ports-domain`` (else ``MetaRoutes.no_ports``: 501).

Which ports are listed: every TCP port the guest listens on now (the node's ``GET .../listening``, which never
wakes a sleeping sandbox: then none is listening) and every public one."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from aiohttp import web

from sbx.api.codec import decode_request
from sbx.api.errors import InvalidRequest, Unsupported
from sbx.api.ports import (
    DEFAULT_TOKEN_TTL_SECS,
    LISTENING_PORTS,
    MAX_TOKEN_TTL_SECS,
    Port,
    PortList,
    PortRequest,
    PortToken,
    PortTokenRequest,
)
from sbx.gateway import auth
from sbx.gateway.http import principal_of
from sbx.gateway.keys import hash_secret
from sbx.gateway.ports import credentials
from sbx.gateway.ports.front import PortFront
from sbx.gateway.ports.labels import MAX_PORT
from sbx.gateway.ports.store import PortTokenRecord
from sbx.gateway.state import SandboxRecord, now_rfc3339
from sbx.web.http import json_response, read_json_body

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


def parse_port(raw: str) -> int:
    """A port of the path: 1 to 65535 in plain digits; else 400."""
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_PORT or raw != str(int(raw)):
        raise InvalidRequest(f"port {raw!r} must be an integer from 1 to {MAX_PORT}")
    return int(raw)


def check_ttl(ttl_secs: int) -> int:
    if not 1 <= ttl_secs <= MAX_TOKEN_TTL_SECS:
        raise InvalidRequest(
            f"ttl_secs must be from 1 to {MAX_TOKEN_TTL_SECS} (seconds; 24 hours at most), not {ttl_secs}"
        )
    return ttl_secs


class PortRoutes:
    """The four endpoints, over the ports front (URLs, the public flags and tokens it serves by)."""

    def __init__(self, gw: Gateway, front: PortFront) -> None:
        self.gw = gw
        self.front = front

    async def _target(self, request: web.Request) -> SandboxRecord:
        rec = await self.gw.sandboxes.find(principal_of(request), request.match_info["ref"])
        request[auth.TARGET_KEY] = rec.id
        return rec

    async def _listening(self, rec: SandboxRecord) -> set[int]:
        node = self.gw.node_for(rec.node, f"sandbox {rec.id}")
        if node.status is not None and not node.status.capabilities.capabilities.get(LISTENING_PORTS, False):
            raise Unsupported(
                f"node {node.name} holding sandbox {rec.id} cannot list what its guest listens on (capability "
                f"{LISTENING_PORTS}): upgrade sandboxd there"
            )
        return set((await node.client.listening(rec.id)).ports)

    def _port(self, request: web.Request, rec: SandboxRecord, port: int, listening: set[int]) -> Port:
        return Port(port=port, url=self.front.url(rec.id, port, request.scheme),
                    public=self.front.db.is_public(rec.id, port), listening=port in listening)  # fmt: skip

    async def list(self, request: web.Request) -> web.Response:
        rec = await self._target(request)
        listening = await self._listening(rec)
        numbers = sorted(listening | set(self.front.db.public_of(rec.id)))
        return json_response(PortList([self._port(request, rec, p, listening) for p in numbers]))

    async def get(self, request: web.Request) -> web.Response:
        rec = await self._target(request)
        port = parse_port(request.match_info["port"])
        return json_response(self._port(request, rec, port, await self._listening(rec)))

    async def put(self, request: web.Request) -> web.Response:
        rec = await self._target(request)
        port = parse_port(request.match_info["port"])
        body = decode_request(await read_json_body(request), PortRequest)
        self.front.url(rec.id, port, request.scheme)  # a sandbox no URL can name is refused before any change
        await self.front.db.set_public(rec.id, port, body.public, now_rfc3339())
        return json_response(self._port(request, rec, port, await self._listening(rec)))

    async def create_token(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        rec = await self._target(request)
        port = parse_port(request.match_info["port"])
        body = decode_request(await read_json_body(request), PortTokenRequest, empty_is_object=True)
        ttl = check_ttl(body.ttl_secs if isinstance(body.ttl_secs, int) else DEFAULT_TOKEN_TTL_SECS)
        url = self.front.url(rec.id, port, request.scheme)
        assert principal.key_id is not None  # a route of the table: always a key
        secret = credentials.new_token()
        expires = time.time() + ttl
        await self.front.db.add_token(PortTokenRecord(
            token_sha256=hash_secret(secret), sandbox=rec.id, port=port, key_id=principal.key_id,
            user=principal.user, tenant=principal.tenant, expires_at=expires, created=now_rfc3339(),
        ))  # fmt: skip
        expires_at = datetime.fromtimestamp(expires, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        return json_response(
            PortToken(token=secret, url=credentials.token_url(url, secret), expires_at=expires_at), status=201
        )
