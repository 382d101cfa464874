"""Attach: a process's output replayed from the start and followed, its stdin, signals and resizes, as frames.

Each attach follows the output log on its own (bounded reads at the client's pace, so a slow reader only
slows itself), up to streams.MAX_ATTACHES (64) per sandbox at once. Closing the connection detaches; the process goes on.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from sbx.api import frames
from sbx.api.errors import InvalidRequest, SandboxError
from sbx.api.processes import OutputChunk
from sbx.node.context import NodeContext
from sbx.node.processes import SIGNALS
from sbx.node.routes.processes import parse_pid
from sbx.node.sandbox import Sandbox
from sbx.node.streams import holding
from sbx.web.upgrade import RawStream, check_upgrade, finished_response, upgrade

_STREAM_TYPES = {"stdout": frames.STDOUT, "stderr": frames.STDERR}


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    async def attach(request: web.Request) -> web.StreamResponse:
        sandbox = ctx.manager.resolve(request.match_info["ref"])
        pid = parse_pid(request)
        sandbox.processes.get(pid)  # 404 before switching protocols
        check_upgrade(request, frames.PROTOCOL)
        with holding(ctx.streams.attaches, sandbox.record.id, "attaches"):
            await _attached(sandbox, pid, await upgrade(request, frames.PROTOCOL))
        return finished_response()

    return [web.get("/v1/sandboxes/{ref}/processes/{pid}/attach", attach)]


async def _attached(sandbox: Sandbox, pid: int, stream: RawStream) -> None:
    """Relay until the output is all sent (the process exited) or the client closes its side."""
    sending = asyncio.create_task(_send_output(sandbox, pid, stream))
    receiving = asyncio.create_task(_receive_input(sandbox, pid, stream))
    try:
        # The client's EOF detaches: a socket closed by a client that has gone cannot be told from a
        # half-closed one until a write fails, and a process that prints nothing would keep a gone client's
        # attach (and its slot) until it exits. Input ends with an `e` frame, never with a half-close.
        await asyncio.wait({sending, receiving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sending, receiving):
            task.cancel()
        await asyncio.gather(sending, receiving, return_exceptions=True)
        await stream.close()


async def _send_output(sandbox: Sandbox, pid: int, stream: RawStream) -> None:
    async for event in sandbox.processes.follow(pid):
        if isinstance(event, OutputChunk):
            stream.writer.write(frames.encode_chunks(_STREAM_TYPES[event.stream], event.data))
        else:
            stream.writer.write(frames.exit_frame(event.exit_code))
        # Backpressure: wait while the client is slow; the output log keeps the rest.
        await stream.writer.drain()


async def _receive_input(sandbox: Sandbox, pid: int, stream: RawStream) -> None:
    decoder = frames.FrameDecoder(frames.CLIENT_TYPES)
    processes = sandbox.processes
    while data := await stream.reader.read(64 * 1024):
        sandbox.touch()
        try:
            received = decoder.feed(data)
        except InvalidRequest:
            return  # a client that breaks the framing is dropped; the process goes on
        for frame in received:
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
