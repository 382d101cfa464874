"""Relay bytes between two TCP sockets in the kernel: splice(2) through a pipe, driven by the event loop.

The egress proxy's data path. Each direction moves up to :data:`CHUNK_BYTES` per readiness event from the
source socket into a pipe and from the pipe into the destination socket, never copying through Python; when
the destination cannot take more, the source is no longer read (flow control), so at most one pipe's worth
(:data:`PIPE_BYTES`) is held per direction. End of stream in one direction is passed on as a half-close
(``shutdown(SHUT_WR)``); the relay is done when both directions are, or at the first error.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
from collections.abc import Callable
from typing import Final

#: Bytes moved per splice call.
CHUNK_BYTES: Final = 1 << 20
#: Capacity asked for each direction's pipe (the kernel may give less).
PIPE_BYTES: Final = 1 << 20
_F_SETPIPE_SZ: Final = 1031
_FLAGS: Final = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK


class _Direction:
    """One direction: ``src`` -> pipe -> ``dst``."""

    def __init__(self, relay: SpliceRelay, src: socket.socket, dst: socket.socket, index: int) -> None:
        self.relay = relay
        self.src = src
        self.dst = dst
        self.index = index
        self.pipe_r, self.pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.fcntl(self.pipe_w, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # above /proc/sys/fs/pipe-max-size for an unprivileged process: the default 64 KiB will do
        self.pending = 0
        self.eof = False
        self.done = False
        self.reading = False
        self.writing = False

    def start(self) -> None:
        self._read_on()

    def _read_on(self) -> None:
        if not self.reading:
            self.relay.loop.add_reader(self.src.fileno(), self._readable)
            self.reading = True

    def _read_off(self) -> None:
        if self.reading:
            self.relay.loop.remove_reader(self.src.fileno())
            self.reading = False

    def _write_on(self) -> None:
        if not self.writing:
            self.relay.loop.add_writer(self.dst.fileno(), self._writable)
            self.writing = True

    def _write_off(self) -> None:
        if self.writing:
            self.relay.loop.remove_writer(self.dst.fileno())
            self.writing = False

    def _readable(self) -> None:
        try:
            moved = os.splice(self.src.fileno(), self.pipe_w, CHUNK_BYTES, flags=_FLAGS)
        except BlockingIOError:
            return
        except OSError as exc:
            self.relay.fail(exc)
            return
        if moved == 0:
            self.eof = True
            self._read_off()
        elif self.relay.on_moved is not None:
            self.relay.on_moved(self.index, moved)
        self.pending += moved
        self._flush()

    def _writable(self) -> None:
        self._flush()

    def _flush(self) -> None:
        while self.pending:
            try:
                moved = os.splice(self.pipe_r, self.dst.fileno(), self.pending, flags=_FLAGS)
            except BlockingIOError:
                self._read_off()  # the destination is full: stop reading until it drains
                self._write_on()
                return
            except OSError as exc:
                self.relay.fail(exc)
                return
            self.pending -= moved
        self._write_off()
        if self.eof:
            self._finish()
        else:
            self._read_on()

    def _finish(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.relay.ended[self.index].set()
        self.relay.direction_done()

    def stop(self) -> None:
        self._read_off()
        self._write_off()
        for fd in (self.pipe_r, self.pipe_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.pipe_r = self.pipe_w = -1


class SpliceRelay:
    """Relays between the non-blocking sockets ``a`` and ``b`` until both directions ended (:meth:`wait`
    returns) or one failed (:meth:`wait` raises that OSError). :meth:`stop` ends it at once; the sockets are
    the caller's to close, after stop.

    ``on_moved(direction, n)``, if given, is called as ``n`` bytes are read in a direction (0: ``a`` to ``b``,
    1: ``b`` to ``a``); ``ended[direction]`` is set once that direction has passed on its end of stream."""

    def __init__(
        self, a: socket.socket, b: socket.socket, on_moved: Callable[[int, int], None] | None = None
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.on_moved = on_moved
        self.ended = (asyncio.Event(), asyncio.Event())
        self._done: asyncio.Future[None] = self.loop.create_future()
        self._directions = [_Direction(self, a, b, 0), _Direction(self, b, a, 1)]
        self._stopped = False
        for direction in self._directions:
            direction.start()

    def direction_done(self) -> None:
        if all(d.done for d in self._directions) and not self._done.done():
            self._done.set_result(None)

    def fail(self, exc: OSError) -> None:
        if not self._done.done():
            self._done.set_exception(exc)
        self.stop()

    def stop(self) -> None:
        """Stop moving bytes (idempotent); a pending :meth:`wait` returns."""
        if self._stopped:
            return
        self._stopped = True
        for direction in self._directions:
            direction.stop()
        if not self._done.done():
            self._done.set_result(None)

    async def wait(self) -> None:
        try:
            await self._done
        finally:
            self.stop()
