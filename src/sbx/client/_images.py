"""``client.images``: the node's image store (capability ``images``; a gateway answers 501)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sbx.api.errors import Internal

if TYPE_CHECKING:
    from sbx.client._client import AsyncClient


class Images:
    """Install, list and remove images on the server; each call is one request."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self) -> list[dict[str, Any]]:
        """``GET /v1/images``: the Image objects, by name."""
        body = await self._client.request("GET", "/v1/images")
        images = body.get("images") if isinstance(body, dict) else None
        if not isinstance(images, list):
            raise Internal("the server's image list has no 'images' array")
        return images

    async def pull(self, image: str) -> dict[str, Any]:
        """``POST /v1/images``: start installing ``image`` (202); the Image with its state.

        The install runs in the background: poll ``list()`` for ``state`` and ``progress``.
        """
        body = await self._client.request("POST", "/v1/images", json={"image": image})
        if not isinstance(body, dict):
            raise Internal("the server answered an image pull without the Image object")
        return body

    async def remove(self, image: str) -> dict[str, Any]:
        """``DELETE /v1/images?image=``: ``{image, freed_bytes}``; 404 when not installed."""
        body = await self._client.request("DELETE", "/v1/images", params={"image": image})
        return body if isinstance(body, dict) else {"image": image}
