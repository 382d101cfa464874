"""``client.ssh``: SSH into sandboxes through a gateway (spec: Gateway-only endpoints; docs/ssh.md). A gateway
serving no SSH answers these 404 ``unsupported`` (``NotServed``); a plain node 404."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from msgspec import UNSET

from sbx.api.ssh import SshAccess, SshAccessRequest, SshInfo, SshKey, SshKeyList, SshKeyRequest

if TYPE_CHECKING:
    from sbx.client._client import AsyncClient


class Ssh:
    """Where the gateway's SSH server listens, the caller's SSH keys, and short-lived logins."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def info(self) -> SshInfo:
        """``GET /v1/ssh``: host, port, host keys (OpenSSH lines) and the ed25519 key's fingerprint."""
        return await self._client.call("GET", "/v1/ssh", SshInfo)

    async def access(self, ref: str, ttl_secs: int | None = None) -> SshAccess:
        """``POST /v1/sandboxes/{ref}/ssh-access``: a token login to the sandbox (``user`` is the token, shown
        only here), good for ``ttl_secs`` (default 15 minutes, at most 24 hours)."""
        body = SshAccessRequest(ttl_secs=ttl_secs if ttl_secs is not None else UNSET)
        path = f"/v1/sandboxes/{quote(ref, safe='')}/ssh-access"
        return await self._client.call("POST", path, SshAccess, json=body)

    async def keys(self) -> list[SshKey]:
        """``GET /v1/ssh-keys``: the caller's registered keys."""
        return (await self._client.call("GET", "/v1/ssh-keys", SshKeyList)).keys

    async def add_key(self, key: str, sandbox: str | None = None) -> SshKey:
        """``POST /v1/ssh-keys``: register one public key line (``ssh-ed25519 AAAA... comment``), for every
        sandbox of the caller's or only ``sandbox`` (an id or name, kept as the id)."""
        body = SshKeyRequest(key=key, sandbox=sandbox if sandbox is not None else UNSET)
        return await self._client.call("POST", "/v1/ssh-keys", SshKey, json=body)

    async def remove_key(self, key_id: str) -> None:
        """``DELETE /v1/ssh-keys/{id}``: forget it; connections that logged in with it are closed first."""
        await self._client.request("DELETE", f"/v1/ssh-keys/{quote(key_id, safe='')}")
