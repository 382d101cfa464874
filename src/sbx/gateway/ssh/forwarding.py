"""Local port forwarding (``ssh -L``): a ``direct-tcpip`` channel to the sandbox's loopback, through the node's
tunnel (``GET .../tunnel?port=N``, ``sbx-tunnel/1``).

Only the sandbox's own loopback is reachable, as through the tunnel endpoint: the destination must be
``localhost``, ``127.0.0.1`` or ``::1`` (meaning the sandbox's 127.0.0.1). Any other host is refused with
"administratively prohibited" and a message, before anything is opened. The tunnel is opened before the
channel is confirmed, so nothing listening on the port is an ordinary "connect failed" with the node's reason.
Bytes are copied both ways with flow control on each side; a half-close is passed through; the channel
closes when both directions have.

Remote forwarding (``ssh -R``) and agent forwarding are refused (see ``server.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import asyncssh
from asyncssh.stream import SSHTCPStreamSession

from sbx.api.errors import SandboxError

if TYPE_CHECKING:
    from sbx.gateway.ssh.server import SshConnection

#: Destinations meaning "the sandbox's loopback".
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})
_READ_BYTES = 64 * 1024


def check_destination(host: str, port: int) -> None:
    """Raise ``ChannelOpenError`` unless ``host:port`` is a port on the sandbox's loopback."""
    if host.lower() not in LOOPBACK_NAMES:
        raise asyncssh.ChannelOpenError(
            asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED,
            f"only the sandbox's own loopback is reachable: forward to localhost:PORT, not {host[:64]}",
        )
    if not 0 < port < 65536:
        raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, f"port {port} is not 1 to 65535")


class Forward:
    """One forwarded connection: the SSH channel and the node's tunnel."""

    def __init__(self, conn: SshConnection, port: int) -> None:
        self.conn = conn
        self.port = port
        self._tunnel: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def open(self) -> SSHTCPStreamSession[bytes]:
        """Open the tunnel; the session the channel is served by. ``ChannelOpenError`` when it cannot."""
        login = self.conn.login
        assert login is not None
        try:
            node = self.conn.server.nodes.node_for(login.sandbox.node, f"sandbox {login.sandbox.id}")
            self._tunnel = await node.client.tunnel(login.sandbox.id, self.port)
        except SandboxError as exc:
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, exc.message) from None
        self.conn.audit_session("forward", port=self.port)
        return SSHTCPStreamSession(self._serve)

    async def _serve(
        self, ssh_reader: asyncssh.SSHReader[bytes], ssh_writer: asyncssh.SSHWriter[bytes]
    ) -> None:
        assert self._tunnel is not None
        reader, writer = self._tunnel
        self.conn.forwards.add(self)

        async def to_sandbox() -> None:
            while data := await ssh_reader.read(_READ_BYTES):
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        async def to_client() -> None:
            while data := await reader.read(_READ_BYTES):
                ssh_writer.write(data)
                await ssh_writer.drain()
            ssh_writer.write_eof()

        tasks = [asyncio.create_task(to_sandbox()), asyncio.create_task(to_client())]
        try:
            # Both directions run until each has closed; a failure of either ends the forward.
            for finished in asyncio.as_completed(tasks):
                await finished
        except (OSError, asyncssh.Error):
            pass
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.conn.forwards.discard(self)
            self.close()
            with contextlib.suppress(OSError, asyncssh.Error):
                ssh_writer.close()

    def close(self) -> None:
        """Close the node's side (the channel goes with the connection, or when the pumps end)."""
        if self._tunnel is not None:
            self._tunnel[1].close()
