"""Upgraded connections: an attached process (``sbx-stream/1`` frames) and a tunnel (raw TCP bytes).

Both own one connection; close them (or use ``async with``) when done. Closing an attachment
detaches and never stops the process.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Self

from sbx.api import frames
from sbx.api.errors import InvalidRequest, Unavailable
from sbx.api.frames import Frame, FrameDecoder

#: Bytes asked of the connection per read.
READ_CHUNK_BYTES = 64 * 1024


class Attachment:
    """A process attached over ``sbx-stream/1``: send input frames, receive output frames.

    ``recv()`` returns the next ``Frame`` (``o`` stdout, ``E`` stderr, ``x`` exit) or ``None``
    when the server closed the stream; ``async for frame in attachment`` does the same until the
    end. After the ``x`` frame ``exit_code`` holds the process's exit code. Sending and receiving
    may run in different tasks at once.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pid: int) -> None:
        self.pid = pid
        self.exit_code: int | None = None
        self._reader = reader
        self._writer = writer
        self._decoder = FrameDecoder(frames.SERVER_TYPES)
        self._ready: deque[Frame] = deque()
        self._send_lock = asyncio.Lock()

    async def send(self, type: bytes, payload: bytes = b"") -> None:
        """Send one frame (a payload over 1 MiB is split into several frames of the same type)."""
        await self._send_raw(frames.encode_chunks(type, payload))

    async def write_stdin(self, data: bytes) -> None:
        """Send ``data`` to the process's stdin (``i`` frames)."""
        if data:
            await self.send(frames.STDIN, data)

    async def close_stdin(self) -> None:
        """End the input (``e``): stdin is closed; a terminal gets ^D."""
        await self.send(frames.END_OF_INPUT)

    async def signal(self, name: str) -> None:
        """Send ``INT``, ``TERM``, ``KILL`` or ``HUP`` to the process (``s``)."""
        await self._send_raw(frames.signal_frame(name))

    async def resize(self, rows: int, cols: int) -> None:
        """Resize the process's terminal to ``rows`` x ``cols`` characters (``r``)."""
        await self._send_raw(frames.resize_frame(rows, cols))

    async def recv(self) -> Frame | None:
        """The next frame from the server, or ``None`` once it closed the stream."""
        while not self._ready:
            try:
                data = await self._reader.read(READ_CHUNK_BYTES)
            except (ConnectionError, OSError) as exc:
                raise Unavailable(f"the attach stream of process {self.pid} broke: {exc}") from exc
            if not data:
                if self._decoder.pending_bytes:
                    raise Unavailable(
                        f"the attach stream of process {self.pid} ended in the middle of a frame"
                    )
                return None
            try:
                self._ready.extend(self._decoder.feed(data))
            except InvalidRequest as exc:
                raise Unavailable(f"the server sent a malformed frame: {exc.message}") from exc
        frame = self._ready.popleft()
        if frame.type == frames.EXIT:
            try:
                self.exit_code = frames.decode_exit(frame.payload)
            except InvalidRequest as exc:
                raise Unavailable(f"the server sent a malformed exit frame: {exc.message}") from exc
        return frame

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[Frame]:
        while (frame := await self.recv()) is not None:
            yield frame

    async def close(self) -> None:
        """Detach: close the connection (the process keeps running)."""
        await _close(self._writer)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _send_raw(self, wire: bytes) -> None:
        async with self._send_lock:
            try:
                self._writer.write(wire)
                await self._writer.drain()
            except (ConnectionError, OSError) as exc:
                raise Unavailable(f"the attach stream of process {self.pid} broke: {exc}") from exc


class Tunnel:
    """A TCP connection to ``127.0.0.1:port`` inside a sandbox, as an asyncio reader and writer.

    ``writer.write_eof()`` half-closes toward the guest (not available over TLS, where asyncio
    cannot half-close); ``reader`` reaches EOF when the guest side closes or half-closes.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
        self.reader = reader
        self.writer = writer
        self.port = port

    async def close(self) -> None:
        """Close the connection both ways."""
        await _close(self.writer)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        # Already broken by the peer: closed is what we wanted.
        pass
