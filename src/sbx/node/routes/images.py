"""Images (capability ``images``): list, install in the background, remove."""

from __future__ import annotations

from aiohttp import web

from sbx.api.errors import InvalidRequest
from sbx.api.models import decode_object
from sbx.api.validation import validate_image_ref
from sbx.node.context import NodeContext
from sbx.node.http import json_response, query_one, read_json_body


def parse_install(body: bytes) -> str:
    """The ``image`` of a ``{image}`` body; anything else is 400."""
    obj = decode_object(body)
    unknown = sorted(set(obj) - {"image"})
    if unknown:
        raise InvalidRequest(f"unknown field {unknown[0]!r}; POST /v1/images takes only image")
    image = obj.get("image")
    if not isinstance(image, str):
        raise InvalidRequest("image is required: a reference such as 'python:3.12'")
    return validate_image_ref(image)


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    images = ctx.images

    async def list_images(request: web.Request) -> web.Response:
        return json_response({"images": images.list()})

    async def install(request: web.Request) -> web.Response:
        return json_response(images.install(parse_install(await read_json_body(request))), status=202)

    async def remove(request: web.Request) -> web.Response:
        return json_response(await images.remove(validate_image_ref(query_one(request, "image"))))

    return [
        web.get("/v1/images", list_images),
        web.post("/v1/images", install),
        web.delete("/v1/images", remove),
    ]
