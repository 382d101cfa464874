"""Attach: a process's output replayed from the start and followed, its stdin, signals and resizes, as frames,
over an upgraded connection (``sbx-stream/1``) or a WebSocket (``websocket_attach``, the same frames in binary
messages: ``sbx.web.websocket``).

Each attach follows the output log on its own (bounded reads at the client's pace, so a slow reader only
slows itself), up to streams.MAX_ATTACHES (64) per sandbox at once, both forms together. Closing the connection
detaches; the process goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from sbx.api import frames
from sbx.api.errors import InvalidRequest, SandboxError
from sbx.api.processes import OutputChunk
from sbx.node.context import NodeContext
from sbx.node.processes import SIGNALS
from sbx.node.routes.processes import parse_pid
from sbx.node.sandbox import Sandbox
from sbx.node.streams import holding
from sbx.web import websocket
from sbx.web.upgrade import RawStream, check_upgrade, finished_response, upgrade

_STREAM_TYPES = {"stdout": frames.STDOUT, "stderr": frames.STDERR}

#: Sends the bytes of whole frames to the client, waiting while it is slow.
Send = Callable[[bytes], Awaitable[None]]


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    def attached_process(request: web.Request) -> tuple[Sandbox, int]:
        sandbox = ctx.manager.resolve(request.match_info["ref"])
        pid = parse_pid(request)
        sandbox.processes.get(pid)  # 404 before switching protocols
        return sandbox, pid

    async def attach(request: web.Request) -> web.StreamResponse:
        sandbox, pid = attached_process(request)
        check_upgrade(request, frames.PROTOCOL)
        await ctx.manager.wake_for_guest(
            sandbox, running=False
        )  # a dormant persistent sandbox wakes for its terminal
        with holding(ctx.streams.attaches, sandbox.record.id, "attaches"):
            stream = await upgrade(request, frames.PROTOCOL)
            try:
                await _attached(sandbox, pid, _raw_sender(stream), _raw_frames(stream))
            finally:
                await stream.close()
        return finished_response()

    async def attach_websocket(request: web.Request) -> web.StreamResponse:
        sandbox, pid = attached_process(request)
        websocket.check_websocket(request)
        await ctx.manager.wake_for_guest(sandbox, running=False)
        with holding(ctx.streams.attaches, sandbox.record.id, "attaches"):
            ws = await websocket.accept(request)
            try:
                await _attached(sandbox, pid, ws.send_bytes, websocket.client_frames(ws))
            finally:
                await ws.close()
        return ws

    return [
        web.get("/v1/sandboxes/{ref}/processes/{pid}/attach", attach),
        web.get("/v1/sandboxes/{ref}/processes/{pid}/attach/websocket", attach_websocket),
    ]


def _raw_sender(stream: RawStream) -> Send:
    async def send(data: bytes) -> None:
        stream.writer.write(data)
        await stream.writer.drain()

    return send


async def _raw_frames(stream: RawStream) -> AsyncIterator[list[frames.Frame]]:
    """The client's frames as they complete, however the bytes are split; a client that breaks the framing is
    dropped (the process goes on)."""
    decoder = frames.FrameDecoder(frames.CLIENT_TYPES)
    while data := await stream.reader.read(64 * 1024):
        try:
            yield decoder.feed(data)
        except InvalidRequest:
            return


async def _attached(
    sandbox: Sandbox, pid: int, send: Send, received: AsyncIterator[list[frames.Frame]]
) -> None:
    """Relay until the output is all sent (the process exited) or the client's input ends."""
    sending = asyncio.create_task(_send_output(sandbox, pid, send))
    receiving = asyncio.create_task(_receive_input(sandbox, pid, received))
    try:
        # The client's EOF detaches: a socket closed by a client that has gone cannot be told from a
        # half-closed one until a write fails, and a process that prints nothing would keep a gone client's
        # attach (and its slot) until it exits. Input ends with an `e` frame, never with a half-close.
        await asyncio.wait({sending, receiving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sending, receiving):
            task.cancel()
        await asyncio.gather(sending, receiving, return_exceptions=True)


async def _send_output(sandbox: Sandbox, pid: int, send: Send) -> None:
    async for event in sandbox.processes.follow(pid):
        if isinstance(event, OutputChunk):
            data = frames.encode_chunks(_STREAM_TYPES[event.stream], event.data)
        else:
            data = frames.exit_frame(event.exit_code)
        # Backpressure: wait while the client is slow; the output log keeps the rest.
        await send(data)


async def _receive_input(sandbox: Sandbox, pid: int, received: AsyncIterator[list[frames.Frame]]) -> None:
    processes = sandbox.processes
    async for batch in received:
        sandbox.touch()
        for frame in batch:
            try:
                if frame.type == frames.STDIN:
                    await processes.send_stdin(pid, frame.payload)
                elif frame.type == frames.END_OF_INPUT:
                    await processes.close_stdin(pid)
                elif frame.type == frames.SIGNAL:
                    await processes.signal(pid, SIGNALS[frames.decode_signal(frame.payload)])
                elif frame.type == frames.RESIZE:
                    await processes.resize(pid, *frames.decode_resize(frame.payload))
            except SandboxError:
                # Input for a process that has exited (or a bad frame) is dropped; output and the exit
                # frame still reach the client.
                continue
