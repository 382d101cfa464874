"""Handlers of the SSH endpoints: where the SSH server listens, SSH keys (the caller's, and an admin's view of
anyone's), and short-lived access tokens (spec: Gateway-only endpoints; docs/ssh.md).

A gateway started without ``--ssh-listen`` answers each of them 404 ``unsupported`` before reading anything.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from aiohttp import web
from msgspec import UNSET

from sbx.api.codec import decode_request
from sbx.api.errors import Conflict, InvalidRequest, NotFound, NotServed
from sbx.api.ssh import SshAccess, SshAccessRequest, SshKeyList, SshKeyRequest
from sbx.gateway import auth
from sbx.gateway.http import principal_of
from sbx.gateway.keys import check_user
from sbx.gateway.ssh.keys import ParsedKey, hash_token, new_token, parse_key_line
from sbx.gateway.state import SshKeyRecord, SshTokenRecord, now_rfc3339
from sbx.web.http import json_response, query_one, read_json_body

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway
    from sbx.gateway.ssh.server import SshServer

#: An access token's lifetime when the request names none (or 0), and the longest allowed, in seconds.
DEFAULT_TTL_SECS = 15 * 60
MAX_TTL_SECS = 24 * 3600
SSH_KEY_ID_PREFIX = "ssh_"


class SshRoutes:
    """``/v1/ssh``, ``/v1/ssh-keys``, ``.../ssh-access`` and ``/v1/admin/ssh-keys``."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.store = gw.store
        #: Registrations one at a time: the checks that a key is not registered yet and its write go together.
        self._adding = asyncio.Lock()

    def _served(self) -> SshServer:
        server = self.gw.ssh
        if server is None:
            raise NotServed("this gateway serves no SSH: start it with --ssh-listen HOST:PORT")
        return server

    async def info(self, request: web.Request) -> web.Response:
        return json_response(self._served().info(request.url.host))

    # -- the caller's keys ---------------------------------------------------------------------

    async def add_key(self, request: web.Request) -> web.Response:
        self._served()
        principal = principal_of(request)
        req = decode_request(await read_json_body(request), SshKeyRequest)
        parsed = parse_key_line(req.key)
        sandbox = None
        if req.sandbox is not UNSET:
            sandbox = self.gw.sandboxes.resolve(principal, req.sandbox).id
        # One key's registrations one at a time, on every replica: its checks see every other's.
        async with self._adding, self.gw.reservation(self.gw.name_lock("ssh-key", parsed.fingerprint)):
            record = self._new_key(principal, parsed, sandbox)
            await self.gw.write(self.store.add_ssh_key, record)
        request[auth.TARGET_KEY] = record.id
        return json_response(record.wire(), status=201)

    def _new_key(self, principal: auth.Principal, parsed: ParsedKey, sandbox: str | None) -> SshKeyRecord:
        """The record of a key being registered by the caller for the tenant they act in; 409 when another user
        has it, or the caller has it for the same tenant and sandbox already."""
        person = (principal.user, principal.key_tenant)
        for other in list(self.store.ssh_keys.values()):
            if other.fingerprint != parsed.fingerprint:
                continue
            if (other.user, other.home_tenant) != person:
                raise Conflict(f"the key {parsed.fingerprint} is registered by another user: each key belongs to "
                               "one user; make a key of your own (ssh-keygen -t ed25519)")  # fmt: skip
            if other.tenant == principal.tenant and other.sandbox == sandbox:
                where = f"for sandbox {sandbox}" if sandbox else "for every sandbox of yours in this tenant"
                raise Conflict(f"the key {parsed.fingerprint} is already registered {where} (as {other.id})")
        return SshKeyRecord(
            id=SSH_KEY_ID_PREFIX + secrets.token_hex(8), user=principal.user, home_tenant=principal.key_tenant,
            tenant=principal.tenant, fingerprint=parsed.fingerprint, key=parsed.line, sandbox=sandbox,
            created=now_rfc3339(),
        )  # fmt: skip

    async def list_keys(self, request: web.Request) -> web.Response:
        self._served()
        principal = principal_of(request)
        here = (principal.user, principal.key_tenant, principal.tenant)
        mine = [k for k in list(self.store.ssh_keys.values()) if (k.user, k.home_tenant, k.tenant) == here]
        return json_response(SshKeyList([k.wire() for k in sorted(mine, key=lambda k: (k.created, k.id))]))

    async def delete_key(self, request: web.Request) -> web.Response:
        self._served()
        principal = principal_of(request)
        key_id = request.match_info["id"]
        request[auth.TARGET_KEY] = key_id
        key = self.store.ssh_keys.get(key_id)
        if key is None or (key.user, key.home_tenant) != (principal.user, principal.key_tenant):
            raise NotFound(f"no SSH key {key_id!r} among yours: see GET /v1/ssh-keys")
        await self._remove(key_id)
        return web.Response(status=204)

    async def _remove(self, key_id: str) -> None:
        """Forget the key, then close the connections that logged in with it before answering."""
        await self.gw.write(self.store.remove_ssh_key, key_id)
        await self.gw.access_changed()

    # -- access tokens -------------------------------------------------------------------------

    async def access(self, request: web.Request) -> web.Response:
        server = self._served()
        principal = principal_of(request)
        sandbox = self.gw.sandboxes.resolve(principal, request.match_info["ref"])
        request[auth.TARGET_KEY] = sandbox.id
        req = decode_request(await read_json_body(request), SshAccessRequest, empty_is_object=True)
        ttl = req.ttl_secs if req.ttl_secs is not UNSET else 0
        if not 0 <= ttl <= MAX_TTL_SECS:
            raise InvalidRequest(f"ttl_secs = {ttl}: give 1 to {MAX_TTL_SECS} seconds (24 hours), or 0 for "
                                 f"{DEFAULT_TTL_SECS // 60} minutes")  # fmt: skip
        now = time.time()
        expires = now + (ttl or DEFAULT_TTL_SECS)
        token = new_token()
        record = SshTokenRecord(
            hash_token(token), principal.user, principal.tenant, sandbox.id, expires, now_rfc3339()
        )
        expired = [t.token_sha256 for t in list(self.store.ssh_tokens.values()) if t.expires_at <= now]
        await self.gw.write(self.store.forget_ssh_tokens, expired)
        await self.gw.write(self.store.add_ssh_token, record)
        host, port = server.address(request.url.host)
        when = datetime.fromtimestamp(expires, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        return json_response(
            SshAccess(
                user=token,
                host=host,
                port=port,
                expires_at=when,
                command=server.command(token, request.url.host),
            ),
            status=201,
        )

    # -- admin -----------------------------------------------------------------------------------

    async def admin_list(self, request: web.Request) -> web.Response:
        self._served()
        user = check_user(query_one(request, "user"))
        theirs = [k for k in list(self.store.ssh_keys.values()) if k.user == user]
        return json_response(SshKeyList([k.wire() for k in sorted(theirs, key=lambda k: (k.created, k.id))]))

    async def admin_delete(self, request: web.Request) -> web.Response:
        self._served()
        key_id = request.match_info["id"]
        request[auth.TARGET_KEY] = key_id
        if key_id not in self.store.ssh_keys:
            raise NotFound(f"no SSH key {key_id!r}: see GET /v1/admin/ssh-keys?user=USER")
        await self._remove(key_id)
        return web.Response(status=204)
