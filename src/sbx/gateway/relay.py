"""Forwarding a request to the node that owns its sandbox, and relaying the answer as sent.

Plain answers are read whole and passed on with their status and content type. Streams (ndjson output,
file contents) are passed on chunk by chunk as they arrive. Upgrades (``sbx-stream/1`` attach, ``sbx-tunnel/1``
tunnel) connect to the node by hand, and once the node answers 101 the client's connection is switched too
(``sbx.web.upgrade``) and bytes are copied both ways untouched, half-closes included.

Every relay is registered in ``OpenRequests`` so revocation can end it (see ``revocation``).

Hot path: a node is reached over its session's kept-alive connections; the request body is passed on as the
client sent it (no JSON re-encoding); the relay runs in the handler's own task (no task per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from sbx.api.errors import BadGateway, PayloadTooLarge, Unauthorized
from sbx.gateway.nodeclient import NodeClient, Refusal, describe
from sbx.gateway.revocation import OpenRequest, OpenRequests
from sbx.web.http import stream_body
from sbx.web.upgrade import finished_response, upgrade

log = logging.getLogger(__name__)

#: Answers passed on chunk by chunk instead of read whole.
STREAMED_TYPES = ("application/x-ndjson", "application/octet-stream")
#: Bytes copied per read in an upgraded connection.
COPY_CHUNK_BYTES = 64 * 1024


class CappedBody:
    """A request body streamed to the node, cut at ``cap`` bytes; keeps the 413 it raised, since the HTTP
    client reports a failing body as its own connection error."""

    def __init__(self, request: web.Request, cap: int) -> None:
        if request.content_length is not None and request.content_length > cap:
            raise PayloadTooLarge(
                f"request body of {request.content_length} bytes is over the {cap}-byte limit"
            )
        self._chunks = stream_body(request, cap)
        self.error: PayloadTooLarge | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._chunks:
                yield chunk
        except PayloadTooLarge as exc:
            self.error = exc
            raise


Body = bytes | CappedBody | None


async def guarded(
    request: web.Request,
    op: OpenRequest,
    tracker: OpenRequests,
    work: Coroutine[Any, Any, web.StreamResponse],
) -> web.StreamResponse:
    """Run ``work`` in this handler's task, registered so revocation can end it; an ended one answers 401 or is
    cut off.

    Revocation cancels this task. The cancellation is ours to absorb only when revocation ended ``op`` and
    nothing else (the client going away, a stop) cancelled the task too. ``op`` leaves the registry in the
    same step as ``work`` finishes, so a cancellation can never land after it."""
    task = asyncio.current_task()
    assert task is not None
    op.task = task
    tracker.add(op)
    try:
        return await work
    except asyncio.CancelledError:
        if not op.ended or task.cancelling() != 1:
            raise
        task.uncancel()
        if not op.answered:
            raise Unauthorized(
                "this request was ended because its API key was revoked or lost the scope it needs"
            ) from None
        if request.transport is not None:
            request.transport.close()
        return finished_response()
    finally:
        tracker.remove(op)


async def forward(
    request: web.Request, node: NodeClient, method: str, path_qs: str, body: Body, op: OpenRequest | None
) -> web.StreamResponse:
    """Send one request to ``node`` and relay its answer as sent; no answer at all is 502."""
    try:
        resp = await node.request(method, path_qs, body, request.headers.get("Content-Type"))
    except (aiohttp.ClientError, OSError) as exc:
        if isinstance(body, CappedBody) and body.error is not None:
            raise body.error from None
        raise BadGateway(f"node {node.name} did not answer: {describe(exc)}") from exc
    async with resp:
        content_type = resp.headers.get("Content-Type", "")
        if resp.status < 300 and content_type.split(";")[0].strip() in STREAMED_TYPES:
            out = web.StreamResponse(status=resp.status)
            out.headers["Content-Type"] = content_type
            if resp.content_length is not None:
                out.content_length = resp.content_length
            await out.prepare(request)
            if op is not None:
                op.answered = True
            try:
                async for chunk in resp.content.iter_any():
                    try:
                        await out.write(chunk)
                    except (ConnectionError, OSError):
                        return out  # the client went away; leaving releases the node's connection too
            except (aiohttp.ClientError, OSError) as exc:
                # The node went away mid-stream: cut the client's stream too rather than end it cleanly.
                log.warning("stream from node cut", extra={"node": node.name, "error": describe(exc)})
                if request.transport is not None:
                    request.transport.close()
                return out
            await out.write_eof()
            return out
        try:
            data = await resp.read()
        except (aiohttp.ClientError, OSError) as exc:
            raise BadGateway(f"node {node.name} did not finish its answer: {describe(exc)}") from exc
        headers = {"Content-Type": content_type} if content_type and resp.status != 204 else {}
        return web.Response(status=resp.status, body=data if resp.status != 204 else None, headers=headers)


async def relay_upgrade(
    request: web.Request, node: NodeClient, path_qs: str, protocol: str, op: OpenRequest
) -> web.StreamResponse:
    """Upgrade both sides and copy bytes until both directions have ended; a node refusing the upgrade is
    answered as it answered."""
    opened = await node.open_upgrade(path_qs, protocol)
    if isinstance(opened, Refusal):
        headers = {"Content-Type": opened.content_type} if opened.content_type else {}
        return web.Response(status=opened.status, body=opened.body, headers=headers)
    node_reader, node_writer = opened
    op.closers.append(node_writer.close)
    try:
        client = await upgrade(request, protocol)
    except BaseException:
        node_writer.close()
        raise
    op.closers.append(client.writer.close)
    op.answered = True
    try:
        await asyncio.gather(copy_stream(client.reader, node_writer), copy_stream(node_reader, client.writer))
    finally:
        node_writer.close()
        await client.close()
    return finished_response()


async def copy_stream(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy until EOF, then pass the half-close on; a broken side closes the other."""
    try:
        while True:
            chunk = await src.read(COPY_CHUNK_BYTES)
            if not chunk:
                break
            dst.write(chunk)
            await dst.drain()
        if dst.can_write_eof() and not dst.is_closing():
            dst.write_eof()
    except (ConnectionError, OSError):
        with contextlib.suppress(Exception):
            dst.close()
