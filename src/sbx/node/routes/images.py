"""Images (capability ``images``): list, install in the background, remove."""

from __future__ import annotations

from aiohttp import web

from sbx.api.codec import decode_request
from sbx.api.images import ImageList, ImageRequest
from sbx.api.validation import validate_image_ref
from sbx.node.context import NodeContext
from sbx.web.http import json_response, query_one, read_json_body


def parse_install(body: bytes) -> str:
    """The ``image`` of a ``{image}`` body; anything else is 400."""
    return validate_image_ref(decode_request(body, ImageRequest).image)


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    images = ctx.images

    async def list_images(request: web.Request) -> web.Response:
        return json_response(ImageList(images.list()))

    async def install(request: web.Request) -> web.Response:
        return json_response(images.install(parse_install(await read_json_body(request))), status=202)

    async def remove(request: web.Request) -> web.Response:
        return json_response(await images.remove(validate_image_ref(query_one(request, "image"))))

    return [
        web.get("/v1/images", list_images),
        web.post("/v1/images", install),
        web.delete("/v1/images", remove),
    ]
