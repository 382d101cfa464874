"""``client.admin``: a gateway's fleet operations with an ``admin`` key (spec: Admin endpoints), and who the
key is (``whoami``). A plain node answers these 404."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from msgspec import UNSET

from sbx.api.events import AuditEntries
from sbx.api.gateway import (
    DrainRequest,
    DrainResult,
    GatewayNode,
    Key,
    KeyCreated,
    KeyCreateRequest,
    KeyList,
    LostList,
    LostSandbox,
    NodeList,
    Whoami,
)
from sbx.api.node import CordonRequest
from sbx.api.ssh import SshKey, SshKeyList

if TYPE_CHECKING:
    from sbx.client._client import AsyncClient


class Admin:
    """Nodes (list, cordon, drain), lost sandboxes, the audit log and API keys of a gateway."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def whoami(self) -> Whoami:
        """``GET /v1/whoami``: the key's user, tenant, id, scopes and the organisation acted in."""
        return await self._client.call("GET", "/v1/whoami", Whoami)

    async def nodes(self) -> list[GatewayNode]:
        """``GET /v1/admin/nodes``: every node with its health, cordon and last status."""
        return (await self._client.call("GET", "/v1/admin/nodes", NodeList)).nodes

    async def cordon(self, node: str, cordoned: bool = True) -> GatewayNode:
        """Cordon (``True``) or uncordon a node; kept by the gateway across the node's restarts."""
        path = f"/v1/admin/nodes/{quote(node, safe='')}/cordon"
        return await self._client.call("POST", path, GatewayNode, json=CordonRequest(cordoned))

    async def drain(self, node: str, terminate: bool = False) -> DrainResult:
        """Cordon a node and say what still runs there; with ``terminate`` end its sandboxes."""
        path = f"/v1/admin/nodes/{quote(node, safe='')}/drain"
        return await self._client.call("POST", path, DrainResult, json=DrainRequest(terminate))

    async def lost(self) -> list[LostSandbox]:
        """``GET /v1/admin/lost``: sandboxes on nodes down longer than ``--node-lost-after``."""
        return (await self._client.call("GET", "/v1/admin/lost", LostList)).sandboxes

    async def audit(self, since: str | None = None, limit: int | None = None) -> AuditEntries:
        """``GET /v1/admin/audit``: entries oldest first from ``since`` (RFC 3339), at most ``limit``."""
        params = {k: v for k, v in (("since", since), ("limit", str(limit) if limit else None)) if v}
        return await self._client.call("GET", "/v1/admin/audit", AuditEntries, params=params)

    async def keys(self) -> list[Key]:
        """``GET /v1/admin/keys``: every key, never a secret."""
        return (await self._client.call("GET", "/v1/admin/keys", KeyList)).keys

    async def create_key(self, user: str, scopes: list[str], tenant: str | None = None) -> KeyCreated:
        """``POST /v1/admin/keys``: a new key; its ``secret`` is shown only in this answer."""
        body = KeyCreateRequest(user=user, tenant=tenant if tenant is not None else UNSET, scopes=scopes)
        return await self._client.call("POST", "/v1/admin/keys", KeyCreated, json=body)

    async def revoke_key(self, key_id: str) -> None:
        """``DELETE /v1/admin/keys/{id}``: revoke it; its open requests end before this returns."""
        await self._client.request("DELETE", f"/v1/admin/keys/{quote(key_id, safe='')}")

    async def ssh_keys(self, user: str) -> list[SshKey]:
        """``GET /v1/admin/ssh-keys?user=``: every SSH key ``user`` registered, in any tenant."""
        return (await self._client.call("GET", "/v1/admin/ssh-keys", SshKeyList, params={"user": user})).keys

    async def remove_ssh_key(self, key_id: str) -> None:
        """``DELETE /v1/admin/ssh-keys/{id}``: forget anyone's SSH key; its connections are closed first."""
        await self._client.request("DELETE", f"/v1/admin/ssh-keys/{quote(key_id, safe='')}")
