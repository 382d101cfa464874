"""``client.images``: the node's image store (capability ``images``; a gateway answers 501)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sbx.api.images import Image, ImageList, ImageRemoved, ImageRequest

if TYPE_CHECKING:
    from sbx.client._client import AsyncClient


class Images:
    """Install, list and remove images on the server; each call is one request."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self) -> list[Image]:
        """``GET /v1/images``: the Image objects, by name."""
        return (await self._client.call("GET", "/v1/images", ImageList)).images

    async def pull(self, image: str) -> Image:
        """``POST /v1/images``: start installing ``image`` (202); the Image with its state.

        The install runs in the background: poll ``list()`` for ``state`` and ``progress``.
        """
        return await self._client.call("POST", "/v1/images", Image, json=ImageRequest(image))

    async def remove(self, image: str) -> ImageRemoved:
        """``DELETE /v1/images?image=``: ``{image, freed_bytes}``; 404 when not installed."""
        return await self._client.call("DELETE", "/v1/images", ImageRemoved, params={"image": image})
