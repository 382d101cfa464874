"""The transparent egress proxy every TCP connection of a sandbox is redirected to (docs/network.md, "Proxy").

For each connection: find the sandbox by source address, read the client's first bytes until they name a host
(TLS SNI or HTTP Host, sniff.py), check that name against the sandbox's current policy (rules.py), resolve it
ourselves (dns.Upstream, the resolver's very lookup) and connect to one of *those* addresses on the port the
client dialled; the address the client dialled is ignored, so a name and an address that disagree never
reach the address. Refusals are a TCP reset at once, never a connection left hanging.

A connection that names no host (a direct-IP connection, a protocol other than TLS and HTTP/1, a TLS hello
without SNI) is refused under ``allowlist``. Under ``open`` it goes to the address the client dialled when
that address is public (ranges.py); a client that says nothing for :data:`OPEN_FIRST_BYTES_WAIT_SECS`
(a protocol where the server speaks first, like SSH) is connected too, and its first bytes, when they come,
are still checked: a name then must be permitted and resolve to the address connected to, or the connection
is cut.

Every live connection is kept on its sandbox's :class:`Attachment`, so :meth:`Attachment.set_policy` cuts
those the new policy no longer permits, at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import struct
from collections.abc import Callable
from typing import Final

from sbx.net.attachment import Attachment, Relay, reset, still_permitted
from sbx.net.dns import LookupFailed, Upstream
from sbx.net.ranges import Address, HostAddresses, Kind, Network, classify
from sbx.net.rules import address_permitted, name_permitted
from sbx.net.sniff import MAX_SNIFF_BYTES, Sniffed, Verdict, sniff

log = logging.getLogger(__name__)

#: Under ``allowlist``, how long a client may take to send the bytes naming its host, seconds.
NAME_WAIT_SECS: Final = 10.0
#: Under ``open``, how long a silent client is waited for before connecting it without a name, seconds.
OPEN_FIRST_BYTES_WAIT_SECS: Final = 0.5
#: How long connecting to the destination may take, seconds.
CONNECT_TIMEOUT_SECS: Final = 10.0
#: Bytes moved per read while relaying.
RELAY_CHUNK_BYTES: Final = 256 * 1024
_SO_ORIGINAL_DST: Final = 80


def original_destination(writer: asyncio.StreamWriter) -> tuple[ipaddress.IPv4Address, int]:
    """The address and port the client dialled before nftables redirected it here."""
    sock = writer.get_extra_info("socket")
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack("!2xH4s8x", raw)
    return ipaddress.IPv4Address(packed), port


class Refusal(Exception):
    """A connection is refused; the message says why (logged, never shown to the sandbox: it gets a reset)."""


class EgressProxy:
    """Listens on TCP ``port`` of every host address (0: a free one; :attr:`port` holds it).

    ``attachment_of(address)`` finds the sandbox a source address belongs to; ``sandbox_subnet`` and this
    host's own addresses are forbidden destinations (ranges.py).
    """

    def __init__(
        self,
        upstream: Upstream,
        attachment_of: Callable[[str], Attachment | None],
        sandbox_subnet: Network,
        host_addresses: HostAddresses | None = None,
    ) -> None:
        self.upstream = upstream
        self.attachment_of = attachment_of
        self.sandbox_subnet = sandbox_subnet
        self.host_addresses = host_addresses or HostAddresses()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self, port: int = 0) -> None:
        self._server = await asyncio.start_server(
            self._serve, "0.0.0.0", port, limit=RELAY_CHUNK_BYTES, backlog=1024
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def kind_of(self, address: Address) -> Kind:
        return classify(address, (self.sandbox_subnet,), self.host_addresses.get())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(writer.get_extra_info("peername")[0])
        attachment = self.attachment_of(peer)
        if attachment is None:
            reset(writer)
            return
        try:
            dialled, port = original_destination(writer)
        except OSError:
            reset(writer)
            return
        relay = Relay(None, "forbidden", writer)
        try:
            await self._admit(attachment, relay, reader, dialled, port)
        except Refusal as exc:
            log.info(
                "egress refused",
                extra={"sandbox": attachment.sandbox_id, "port": port, "reason": str(exc)},
            )
            relay.cut()
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            relay.cut()
        except Exception:  # a bug must cost one connection, never the listener
            log.exception("egress proxy failure", extra={"sandbox": attachment.sandbox_id, "port": port})
            relay.cut()
        finally:
            attachment.relays.discard(relay)

    async def _admit(
        self,
        attachment: Attachment,
        relay: Relay,
        reader: asyncio.StreamReader,
        dialled: ipaddress.IPv4Address,
        port: int,
    ) -> None:
        wait = OPEN_FIRST_BYTES_WAIT_SECS if attachment.policy.mode == "open" else NAME_WAIT_SECS
        try:
            first = await asyncio.wait_for(reader.read(MAX_SNIFF_BYTES), wait)
        except TimeoutError:
            if attachment.policy.mode != "open":
                raise Refusal("the client named no host in time") from None
            # A silent client (the server speaks first): connect by address; its first bytes are checked
            # when they come (_late_check).
            upstream_reader, upstream_writer = await self._connect_nameless(attachment, relay, dialled, port)
            await self._relay(
                attachment, relay, reader, upstream_reader, upstream_writer, b"", late_check=(dialled, port)
            )
            return
        buffered, found = await _read_until_named(reader, first)
        if found.verdict is Verdict.MALFORMED:
            raise Refusal(f"a malformed {found.protocol} request")
        if found.verdict is Verdict.NAME:
            name = found.name
            if not name_permitted(attachment.policy, name):
                raise Refusal(f"{name} is not permitted by the policy")
            relay.name = name
            upstream_reader, upstream_writer = await self._connect_named(
                attachment, relay, name, dialled, port
            )
        else:
            upstream_reader, upstream_writer = await self._connect_nameless(attachment, relay, dialled, port)
        await self._relay(attachment, relay, reader, upstream_reader, upstream_writer, buffered)

    async def _addresses_of(self, attachment: Attachment, name: str) -> set[ipaddress.IPv4Address]:
        """The addresses ``name`` has: what the upstream says now and what the resolver told this sandbox."""
        given = attachment.addresses_given(name)
        try:
            return set(await self.upstream.lookup(name)) | given
        except LookupFailed as exc:
            if given:
                return given
            raise Refusal(f"{name} does not resolve: {exc}") from None

    async def _connect_named(
        self, attachment: Attachment, relay: Relay, name: str, dialled: ipaddress.IPv4Address, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect to ``dialled`` only if it is an address of ``name`` (a name and an address that disagree
        go nowhere) and of a kind the policy permits for a named connection."""
        if dialled not in await self._addresses_of(attachment, name):
            raise Refusal(f"{dialled}, the address dialled, is not an address of {name}")
        kind = self.kind_of(dialled)
        if not address_permitted(attachment.policy, kind, named=True):
            raise Refusal(f"{name} is at {dialled}, a {kind} address")
        relay.kind = kind
        try:
            return await self._open(dialled, port)
        except (OSError, TimeoutError) as exc:
            raise Refusal(f"{name} ({dialled}:{port}) could not be reached: {exc}") from None

    async def _connect_nameless(
        self, attachment: Attachment, relay: Relay, dialled: ipaddress.IPv4Address, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if attachment.policy.mode != "open":
            raise Refusal(f"a connection to {dialled}:{port} names no host; the policy admits names only")
        kind = self.kind_of(dialled)
        if not address_permitted(attachment.policy, kind, named=False):
            raise Refusal(f"{dialled} is a {kind} address")
        relay.kind = kind
        try:
            return await self._open(dialled, port)
        except (OSError, TimeoutError) as exc:
            raise Refusal(f"{dialled}:{port} could not be reached: {exc}") from None

    @staticmethod
    async def _open(address: Address, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.wait_for(
            asyncio.open_connection(str(address), port, limit=RELAY_CHUNK_BYTES), CONNECT_TIMEOUT_SECS
        )

    async def _relay(
        self,
        attachment: Attachment,
        relay: Relay,
        client_reader: asyncio.StreamReader,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
        buffered: bytes,
        late_check: tuple[ipaddress.IPv4Address, int] | None = None,
    ) -> None:
        relay.upstream = upstream_writer
        if not still_permitted(attachment.policy, relay):
            raise Refusal("the policy changed while connecting")  # a PATCH came in between
        attachment.relays.add(relay)
        client_writer = relay.client
        for writer in (client_writer, upstream_writer):
            writer.transport.set_write_buffer_limits(high=4 * RELAY_CHUNK_BYTES)
        if buffered:
            upstream_writer.write(buffered)

        async def outbound() -> None:
            if late_check is not None:
                await self._late_check(attachment, relay, client_reader, upstream_writer, late_check)
            await _pump(client_reader, upstream_writer)

        tasks = [asyncio.create_task(outbound()), asyncio.create_task(_pump(upstream_reader, client_writer))]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if t.exception() is not None]
            if failed:
                for task in pending:
                    task.cancel()
                relay.cut()
                exc = failed[0].exception()
                if isinstance(exc, Refusal):
                    raise exc
                return
            await asyncio.gather(*pending)
        finally:
            for task in tasks:
                task.cancel()
            for writer in (client_writer, upstream_writer):
                writer.close()

    async def _late_check(
        self,
        attachment: Attachment,
        relay: Relay,
        reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
        connected: tuple[ipaddress.IPv4Address, int],
    ) -> None:
        """The first bytes of a client connected without a name: forwarded only if they name no host, or a
        permitted host that resolves to the address connected to."""
        first = await reader.read(MAX_SNIFF_BYTES)
        if not first:
            return
        buffered, found = await _read_until_named(reader, first)
        if found.verdict is Verdict.MALFORMED:
            raise Refusal(f"a malformed {found.protocol} request")
        if found.verdict is Verdict.NAME:
            name = found.name
            if not name_permitted(attachment.policy, name):
                raise Refusal(f"{name} is not permitted by the policy")
            if connected[0] not in await self._addresses_of(attachment, name):
                raise Refusal(f"{connected[0]}, the address dialled, is not an address of {name}")
            relay.name = name
        upstream_writer.write(buffered)


async def _read_until_named(reader: asyncio.StreamReader, first: bytes) -> tuple[bytes, Sniffed]:
    """Read on until :func:`sniff` decides (at most MAX_SNIFF_BYTES more, NAME_WAIT_SECS)."""
    buffered = first
    found = sniff(buffered)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + NAME_WAIT_SECS
    while found.verdict is Verdict.MORE and buffered and len(buffered) < 4 * MAX_SNIFF_BYTES:
        try:
            chunk = await asyncio.wait_for(reader.read(MAX_SNIFF_BYTES), max(0.0, deadline - loop.time()))
        except TimeoutError:
            break
        if not chunk:
            break
        buffered += chunk
        found = sniff(buffered)
    if found.verdict is Verdict.MORE:
        # Incomplete when the client stopped sending (or after NAME_WAIT_SECS): a started TLS hello or
        # HTTP head that never ends is malformed; other bytes name nothing.
        found = Sniffed(
            Verdict.MALFORMED if buffered[:1] == b"\x16" or buffered[:1].isupper() else Verdict.NAMELESS
        )
    return buffered, found


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then pass the half-close on."""
    while True:
        data = await reader.read(RELAY_CHUNK_BYTES)
        if not data:
            break
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof() and not writer.is_closing():
        writer.write_eof()
