"""Forwarding a request to the node that owns its sandbox, and relaying the answer as sent.

Plain answers are read whole and passed on with their status and content type. Streams (ndjson output,
file contents) are passed on chunk by chunk as they arrive. Upgrades (``sbx-stream/1`` attach, ``sbx-tunnel/1``
tunnel) connect to the node by hand, and once the node answers 101 the client's connection is switched too
(``sbx.web.upgrade``) and bytes are copied both ways untouched, half-closes included. The WebSocket form of
attach is the gateway's own: the node is attached with ``sbx-stream/1`` and the frames are carried between its
stream and the client's binary messages (``relay_websocket``).

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
from aiohttp import WSCloseCode, web

from sbx.api import frames
from sbx.api.errors import BadGateway, PayloadTooLarge, Unauthorized
from sbx.gateway.nodeclient import NodeClient, Refusal, describe
from sbx.gateway.revocation import OpenRequest, OpenRequests
from sbx.web import websocket
from sbx.web.http import stream_body
from sbx.web.upgrade import finished_response, upgrade

log = logging.getLogger(__name__)

#: Answers passed on chunk by chunk instead of read whole.
STREAMED_TYPES = ("application/x-ndjson", "application/octet-stream")
#: Bytes copied per read in an upgraded connection.
COPY_CHUNK_BYTES = 64 * 1024
#: Why revocation ended a request (a 401 before the node answered; a WebSocket's close reason after).
ENDED_MESSAGE = "this request was ended because its API key was revoked or lost the scope it needs"
#: Seconds a stream ended by revocation may take to say why before its connection is cut.
FAREWELL_TIMEOUT_SECS = 1.0


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
            raise Unauthorized(ENDED_MESSAGE) from None
        if op.farewell is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(FAREWELL_TIMEOUT_SECS):
                    await op.farewell()
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


def refusal_response(refusal: Refusal) -> web.Response:
    """A node's answer to an upgrade it refused, as the node sent it."""
    headers = {"Content-Type": refusal.content_type} if refusal.content_type else {}
    return web.Response(status=refusal.status, body=refusal.body, headers=headers)


async def relay_upgrade(
    request: web.Request, node: NodeClient, path_qs: str, protocol: str, op: OpenRequest
) -> web.StreamResponse:
    """Upgrade both sides and copy bytes until both directions have ended; a node refusing the upgrade is
    answered as it answered."""
    opened = await node.open_upgrade(path_qs, protocol)
    if isinstance(opened, Refusal):
        return refusal_response(opened)
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


async def relay_websocket(
    request: web.Request, node: NodeClient, attach_path_qs: str, op: OpenRequest
) -> web.StreamResponse:
    """The WebSocket form of attach: the node is attached with ``sbx-stream/1`` first (a refusal, such as 404 or
    the attach cap's 503, is answered as the node sent it, before the client's switch); then the whole frames of
    each client message go to the node, and the node's frames come back in messages of whole frames. Revocation
    closes the WebSocket with 1008 and the reason, then cuts both connections."""
    opened = await node.open_upgrade(attach_path_qs, frames.PROTOCOL)
    if isinstance(opened, Refusal):
        return refusal_response(opened)
    node_reader, node_writer = opened
    op.closers.append(node_writer.close)
    try:
        ws = await websocket.accept(request)
    except BaseException:
        node_writer.close()
        raise
    op.answered = True
    op.farewell = lambda: websocket.close(ws, WSCloseCode.POLICY_VIOLATION, ENDED_MESSAGE)
    to_node = asyncio.create_task(_messages_to_node(ws, node_writer))
    to_client = asyncio.create_task(_frames_to_client(node_reader, ws))
    try:
        await asyncio.wait({to_node, to_client}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (to_node, to_client):
            task.cancel()
        await asyncio.gather(to_node, to_client, return_exceptions=True)
        node_writer.close()
    if not ws.closed:
        await ws.close()
    return ws


async def _messages_to_node(ws: web.WebSocketResponse, node_writer: asyncio.StreamWriter) -> None:
    async for batch in websocket.client_frames(ws):
        node_writer.write(b"".join(frames.encode_frame(f.type, f.payload) for f in batch))
        await node_writer.drain()


async def _frames_to_client(node_reader: asyncio.StreamReader, ws: web.WebSocketResponse) -> None:
    decoder = frames.FrameDecoder(frames.SERVER_TYPES)
    while chunk := await node_reader.read(COPY_CHUNK_BYTES):
        batch = decoder.feed(chunk)
        if batch:
            await ws.send_bytes(b"".join(frames.encode_frame(f.type, f.payload) for f in batch))
