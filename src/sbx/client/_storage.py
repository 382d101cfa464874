"""``client.snapshots`` and ``client.volumes``: state that outlives a sandbox (see docs/snapshots.md and
docs/volumes.md). Snapshots are taken with ``sandbox.snapshot()`` and forked with
``client.sandboxes.create(snapshot_id=...)``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from sbx.client._models import array_field, as_object

if TYPE_CHECKING:
    from sbx.client._client import AsyncClient


class Snapshots:
    """List and delete the server's snapshots (capabilities ``memory_snapshot``, ``disk_snapshot``)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self) -> list[dict[str, Any]]:
        """``GET /v1/snapshots``: Snapshot objects, newest first."""
        return array_field(await self._client.request("GET", "/v1/snapshots"), "snapshots")

    async def delete(self, snapshot_id: str) -> None:
        """``DELETE /v1/snapshots/{id}``: remove a snapshot and its files; NotFound when unknown."""
        await self._client.request("DELETE", f"/v1/snapshots/{quote(snapshot_id, safe='')}")


class Volumes:
    """Create, list and delete volumes; mount them with ``sandboxes.create(volumes=[...])``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, name: str, size_mb: int | None = None) -> dict[str, Any]:
        """``POST /v1/volumes``: an empty volume of ``size_mb`` MiB (default: the server's default disk)."""
        body: dict[str, Any] = {"name": name}
        if size_mb is not None:
            body["size_mb"] = size_mb
        return as_object(await self._client.request("POST", "/v1/volumes", json=body), "a Volume")

    async def list(self) -> list[dict[str, Any]]:
        """``GET /v1/volumes``: Volume objects."""
        return array_field(await self._client.request("GET", "/v1/volumes"), "volumes")

    async def delete(self, name: str) -> None:
        """``DELETE /v1/volumes/{name}``: delete it with its contents; Conflict while mounted."""
        await self._client.request("DELETE", f"/v1/volumes/{quote(name, safe='')}")
