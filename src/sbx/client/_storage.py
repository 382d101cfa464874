"""``client.snapshots`` and ``client.volumes``: state that outlives a sandbox (see docs/snapshots.md and
docs/volumes.md). Snapshots are taken with ``sandbox.snapshot()`` and forked with
``client.sandboxes.create(snapshot_id=...)``."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from msgspec import UNSET

from sbx.api.snapshots import Snapshot, SnapshotList
from sbx.api.volumes import Volume, VolumeCreateRequest, VolumeList

if TYPE_CHECKING:
    from sbx.client._client import AsyncClient


class Snapshots:
    """List and delete the server's snapshots (capabilities ``memory_snapshot``, ``disk_snapshot``)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self) -> list[Snapshot]:
        """``GET /v1/snapshots``: Snapshot objects, newest first."""
        return (await self._client.call("GET", "/v1/snapshots", SnapshotList)).snapshots

    async def delete(self, snapshot_id: str) -> None:
        """``DELETE /v1/snapshots/{id}``: remove a snapshot and its files; NotFound when unknown."""
        await self._client.request("DELETE", f"/v1/snapshots/{quote(snapshot_id, safe='')}")


class Volumes:
    """Create, list and delete volumes; mount them with ``sandboxes.create(volumes=[...])``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, name: str, size_mb: int | None = None) -> Volume:
        """``POST /v1/volumes``: an empty volume of ``size_mb`` MiB (default: the server's default disk)."""
        body = VolumeCreateRequest(name, size_mb if size_mb is not None else UNSET)
        return await self._client.call("POST", "/v1/volumes", Volume, json=body)

    async def list(self) -> list[Volume]:
        """``GET /v1/volumes``: Volume objects."""
        return (await self._client.call("GET", "/v1/volumes", VolumeList)).volumes

    async def delete(self, name: str) -> None:
        """``DELETE /v1/volumes/{name}``: delete it with its contents; Conflict while mounted."""
        await self._client.request("DELETE", f"/v1/volumes/{quote(name, safe='')}")
