"""Raw tunnel connections (agent protocol version 4): one connection on the agent's tunnel socket per TCP tunnel.

The host connects to the tunnel socket, sends ``SBXT``, the port (u16) and a zero u16, and reads the agent's
answer, an errno (u32, big-endian; 0 when the agent connected to 127.0.0.1:port in the guest). From then on the
connection carries the TCP connection's bytes both ways, unframed and unacknowledged: each side's flow control
is its socket's, and a half-close is a ``shutdown(SHUT_WR)`` passed on by the agent. Nothing of a raw tunnel
passes through the agent's main connection, so sandboxd can relay it in the kernel (splice) instead of
parsing frames (docs/agent-protocol.md, "Raw tunnels").
"""

from __future__ import annotations

import asyncio
import errno as errno_mod
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Final

from sbx.agent.protocol import AgentRequestError

MAGIC: Final = b"SBXT"
HEADER: Final = struct.Struct(">4sHH")
ANSWER: Final = struct.Struct(">I")
#: The first protocol version whose agent listens on a tunnel socket.
VERSION: Final = 4
#: Name of the tunnel socket beside the agent's own socket.
SOCKET_NAME: Final = "tunnel.sock"


class NoTunnelSocket(Exception):
    """The agent has no tunnel socket (started without one, or it was removed inside the sandbox): use a
    framed tunnel over the main connection instead."""


async def open_raw_tcp(socket_path: Path, port: int, timeout_secs: float = 10.0) -> socket.socket:
    """A non-blocking socket carrying the bytes of a new TCP connection to 127.0.0.1:``port`` in the guest.

    Raises NoTunnelSocket when nothing listens at ``socket_path``, AgentRequestError with the guest's errno
    when the agent could not connect (ECONNREFUSED when nothing listens on the port; ETIMEDOUT after
    ``timeout_secs`` seconds; EMFILE when the agent holds its maximum of tunnels).
    """
    if not 0 < port < 65536:
        raise ValueError(f"port {port} must be from 1 to 65535")
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    try:
        await _connect_nofollow(loop, sock, socket_path)
        await loop.sock_sendall(sock, HEADER.pack(MAGIC, port, 0))
        try:
            answer = await asyncio.wait_for(_read_answer(loop, sock), timeout_secs)
        except TimeoutError:
            raise AgentRequestError(
                errno_mod.ETIMEDOUT, f"no connection within {timeout_secs:g}s (is the server accepting?)"
            ) from None
    except BaseException:
        sock.close()
        raise
    if answer is None:
        sock.close()
        raise AgentRequestError(errno_mod.EMFILE, "the agent holds too many tunnels; close some")
    if answer:
        sock.close()
        why = os.strerror(answer)
        if answer == errno_mod.ECONNREFUSED:
            why = "nothing is listening on that port (connection refused)"
        raise AgentRequestError(answer, why)
    return sock


async def _connect_nofollow(loop: asyncio.AbstractEventLoop, sock: socket.socket, path: Path) -> None:
    """Connect to the socket file at ``path`` itself, never through a symlink root in the guest planted there
    (the same rule as the agent's main socket, sbx.agent.client)."""
    try:
        # O_PATH | O_NOFOLLOW opens a symlink itself, which the check below then refuses.
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise NoTunnelSocket(f"{path} does not exist") from None
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise NoTunnelSocket(f"{path} is not a socket (it was replaced inside the sandbox)")
        try:
            await loop.sock_connect(sock, f"/proc/self/fd/{fd}")
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise NoTunnelSocket(f"nothing accepts on {path}: {exc}") from None
    finally:
        os.close(fd)


async def _read_answer(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> int | None:
    """The agent's errno, or None when it closed without one (it holds its maximum of tunnels)."""
    got = b""
    while len(got) < ANSWER.size:
        chunk = await loop.sock_recv(sock, ANSWER.size - len(got))
        if not chunk:
            return None
        got += chunk
    (err,) = ANSWER.unpack(got)
    return int(err)
