"""The HTTP edge both servers share: JSON answers through the one codec, body caps and streaming, query
parameters, and the one place errors become responses.

Handlers raise ``SandboxError``s and return wire types; ``error_middleware`` turns every failure, including
aiohttp's own (unknown route, wrong method) and bugs, into ``{"error": {"code", "message"}}``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from sbx.api.codec import encode
from sbx.api.errors import Internal, InvalidRequest, NotFound, PayloadTooLarge, SandboxError

log = logging.getLogger(__name__)

#: Body caps from the spec's Limits, in bytes.
JSON_BODY_CAP = 1024 * 1024
FILE_BODY_CAP = 64 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(data: Any, status: int = 200) -> web.Response:
    """A JSON answer (UTF-8, compact) of a wire type or plain JSON values."""
    return web.Response(body=encode(data), status=status, content_type="application/json")


def error_response(error: SandboxError, close: bool = False) -> web.Response:
    response = json_response(error.to_body(), status=error.status)
    if close:
        # The unread rest of an over-cap body is not drained: the client gets the answer, then the close.
        response.force_close()
    return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every non-2xx answer carries the error body; bugs are logged with an id the user can quote."""
    try:
        return await handler(request)
    except PayloadTooLarge as exc:
        return error_response(exc, close=True)
    except SandboxError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status == 404:
            return error_response(NotFound(f"no endpoint {request.method} {request.path}"))
        if exc.status == 405:
            error = InvalidRequest(f"{request.method} is not allowed on {request.path}")
            response = json_response(error.to_body(), status=405)
            return response
        if exc.status >= 400:
            return error_response(InvalidRequest(exc.reason or f"HTTP {exc.status}"))
        raise
    except Exception:
        incident = uuid.uuid4().hex[:12]
        log.exception("unhandled error", extra={"incident": incident, "path": request.path})
        return error_response(Internal(f"internal error (incident {incident} in the sandboxd log)"))


async def read_body(request: web.Request, cap: int) -> bytes:
    """The whole body, refused with 413 past ``cap`` bytes (without reading the rest)."""
    if request.content_length is not None and request.content_length > cap:
        raise PayloadTooLarge(f"request body of {request.content_length} bytes is over the {cap}-byte limit")
    body = await request.content.read(cap + 1)
    if len(body) > cap:
        raise PayloadTooLarge(f"request body is over the {cap}-byte limit")
    # read(n) may return less than n before EOF; keep reading until EOF or the cap.
    chunks = [body]
    total = len(body)
    while not request.content.at_eof():
        chunk = await request.content.read(cap + 1 - total)
        if not chunk:
            break
        total += len(chunk)
        if total > cap:
            raise PayloadTooLarge(f"request body is over the {cap}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_body(request: web.Request) -> bytes:
    """The raw JSON body (decoded by ``sbx.api.codec``), capped at 1 MiB."""
    return await read_body(request, JSON_BODY_CAP)


async def stream_body(request: web.Request, cap: int, chunk_bytes: int = 256 * 1024) -> AsyncIterator[bytes]:
    """The body in chunks, raising 413 as soon as it passes ``cap`` bytes."""
    if request.content_length is not None and request.content_length > cap:
        raise PayloadTooLarge(f"request body of {request.content_length} bytes is over the {cap}-byte limit")
    total = 0
    async for chunk in request.content.iter_chunked(chunk_bytes):
        total += len(chunk)
        if total > cap:
            raise PayloadTooLarge(f"request body is over the {cap}-byte limit")
        yield chunk


def query_one(request: web.Request, name: str) -> str:
    """A required query parameter given exactly once."""
    values = request.query.getall(name, [])
    if not values:
        raise InvalidRequest(f"query parameter {name!r} is required")
    if len(values) > 1:
        raise InvalidRequest(f"query parameter {name!r} given more than once")
    return values[0]
