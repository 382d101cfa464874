"""``client.images``: the node's image store (capability ``images``; a gateway answers 501)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sbx.client._models import array_field, as_object

if TYPE_CHECKING:
    from sbx.client._client import AsyncClient


class Images:
    """Install, list and remove images on the server; each call is one request."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self) -> list[dict[str, Any]]:
        """``GET /v1/images``: the Image objects, by name."""
        return array_field(await self._client.request("GET", "/v1/images"), "images")

    async def pull(self, image: str) -> dict[str, Any]:
        """``POST /v1/images``: start installing ``image`` (202); the Image with its state.

        The install runs in the background: poll ``list()`` for ``state`` and ``progress``.
        """
        return as_object(await self._client.request("POST", "/v1/images", json={"image": image}), "an Image")

    async def remove(self, image: str) -> dict[str, Any]:
        """``DELETE /v1/images?image=``: ``{image, freed_bytes}``; 404 when not installed."""
        body = await self._client.request("DELETE", "/v1/images", params={"image": image})
        return body if isinstance(body, dict) else {"image": image}
