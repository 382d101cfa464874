"""The transparent egress proxy every TCP connection of a sandbox is redirected to (docs/network.md, "Proxy").

For each connection: find the sandbox by source address, read the client's first bytes until they name a host
(TLS SNI or HTTP Host, sniff.py), check that name against the sandbox's current policy (rules.py), check that
the address the client dialled is one of that name's addresses (what the upstream says, or what our resolver
told this sandbox), so that a name and an address that disagree go nowhere, and that its range is permitted
(ranges.py); then connect to it and relay in the kernel (splice.py). Refusals are a TCP reset at once, never a
connection left hanging; a bytes sequence that breaks the TLS or HTTP format is always refused.

A connection that names no host (a direct-IP connection, a protocol other than TLS and HTTP/1, a TLS hello
without SNI) is refused under ``allowlist``. Under ``open`` it goes to the address the client dialled when
that address is public; a client that says nothing for :data:`OPEN_FIRST_BYTES_WAIT_SECS` (a protocol where
the server speaks first, like SSH) is connected too, and its first bytes, when they come, are still checked:
a name then must be permitted and be a name of the address connected to, or the connection is cut.

Every live connection is kept on its sandbox's :class:`Attachment`, so :meth:`Attachment.set_policy` cuts
those the new policy no longer permits, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
from collections.abc import Callable
from typing import Final

from sbx.logratelimit import RateLimitFilter
from sbx.net.accept import accept_forever, listen_tcp
from sbx.net.attachment import Attachment, Relay, reset, still_permitted
from sbx.net.dns import LookupFailed, Upstream
from sbx.net.limits import EgressLimits
from sbx.net.ranges import Address, HostAddresses, Kind, Network, classify
from sbx.net.rules import address_permitted, name_permitted
from sbx.net.sniff import MAX_SNIFF_BYTES, Sniffed, Verdict, sniff
from sbx.net.splice import SpliceRelay

log = logging.getLogger(__name__)
log.addFilter(RateLimitFilter())  # refusals and failures repeat once per connection

#: Under ``allowlist``, how long a client may take to send the bytes naming its host, seconds.
NAME_WAIT_SECS: Final = 10.0
#: Under ``open``, how long a silent client is waited for before connecting it without a name, seconds.
OPEN_FIRST_BYTES_WAIT_SECS: Final = 0.5
#: How long connecting to the destination, or handing it the client's first bytes, may take, seconds.
CONNECT_TIMEOUT_SECS: Final = 10.0
#: TCP keepalive on both sockets of a relay: first probe after this many idle seconds, then every
#: KEEPALIVE_INTERVAL_SECS, the peer declared gone after KEEPALIVE_PROBES unanswered ones, so that a relay
#: whose peer vanished gives its slot back within about two minutes.
KEEPALIVE_IDLE_SECS: Final = 60
KEEPALIVE_INTERVAL_SECS: Final = 10
KEEPALIVE_PROBES: Final = 6
_SO_ORIGINAL_DST: Final = 80


def original_destination(sock: socket.socket) -> tuple[ipaddress.IPv4Address, int]:
    """The address and port the client dialled before nftables redirected it here."""
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack("!2xH4s8x", raw)
    return ipaddress.IPv4Address(packed), port


def keep_alive(sock: socket.socket) -> None:
    """Turn on TCP keepalive with the KEEPALIVE_* timings (a peer that vanished is noticed)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_SECS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_SECS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)


class Refusal(Exception):
    """A connection is refused; the message says why (logged, never shown to the sandbox: it gets a reset)."""


class EgressProxy:
    """Listens on TCP ``port`` of every host address (0: a free one; :attr:`port` holds it).

    ``attachment_of(address)`` finds the sandbox a source address belongs to; ``sandbox_subnet`` and this
    host's own addresses are forbidden destinations (ranges.py). ``limits`` caps the connections held, per
    sandbox and in all (docs/network.md, "Limits"); one past a cap is reset at once.
    """

    def __init__(
        self,
        upstream: Upstream,
        attachment_of: Callable[[str], Attachment | None],
        sandbox_subnet: Network,
        host_addresses: HostAddresses | None = None,
        limits: EgressLimits | None = None,
    ) -> None:
        self.upstream = upstream
        self.attachment_of = attachment_of
        self.sandbox_subnet = sandbox_subnet
        self.host_addresses = host_addresses or HostAddresses()
        #: Connections held (being admitted or relayed), per sandbox.
        self.slots = (limits or EgressLimits()).proxy_slots()
        self.port = 0
        #: See NAME_WAIT_SECS (an attribute so that tests need not wait that long).
        self.name_wait_secs = NAME_WAIT_SECS
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, port: int = 0) -> None:
        self._listener = listen_tcp(port)
        self.port = self._listener.getsockname()[1]
        self._accepting = asyncio.create_task(accept_forever(self._listener, self._accepted, "egress proxy"))

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()

    def dialled(self, conn: socket.socket) -> tuple[ipaddress.IPv4Address, int]:
        """Where the client connected to (see :func:`original_destination`)."""
        return original_destination(conn)

    def kind_of(self, address: Address) -> Kind:
        return classify(address, (self.sandbox_subnet,), self.host_addresses.get())

    def _accepted(self, conn: socket.socket, peer: str) -> None:
        """Serve a new connection, or reset it at once when it is no sandbox's or past a cap."""
        attachment = self.attachment_of(peer)
        if attachment is None or not self.slots.acquire(attachment.sandbox_id):
            if attachment is not None:
                log.warning(
                    "egress connection limit reached; connection reset",
                    extra={"sandbox": attachment.sandbox_id, "connections": self.slots.held(attachment.sandbox_id),
                           "all_connections": self.slots.in_use},
                )  # fmt: skip
            reset(conn)
            return
        task = asyncio.create_task(self._serve(conn, attachment))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: socket.socket, attachment: Attachment) -> None:
        """Admit and relay one connection; gives its slot back when done."""
        relay = Relay(None, "forbidden", conn, task=asyncio.current_task())
        port = 0
        try:
            dialled, port = self.dialled(conn)
            await self._admit(attachment, relay, dialled, port)
        except Refusal as exc:
            log.info(
                "egress refused",
                extra={"sandbox": attachment.sandbox_id, "port": port, "reason": str(exc)},
            )
        except (OSError, TimeoutError):
            pass
        except asyncio.CancelledError:
            relay.cut()
            raise
        except Exception:  # a bug must cost one connection, never the listener
            log.exception("egress proxy failure", extra={"sandbox": attachment.sandbox_id, "port": port})
        finally:
            self.slots.release(attachment.sandbox_id)
            attachment.relays.discard(relay)
            relay.cut()  # a reset when still open (refusals, failures); after a clean end it only closes

    async def _admit(
        self, attachment: Attachment, relay: Relay, dialled: ipaddress.IPv4Address, port: int
    ) -> None:
        loop = asyncio.get_running_loop()
        conn = relay.client
        wait = OPEN_FIRST_BYTES_WAIT_SECS if attachment.policy.mode == "open" else self.name_wait_secs
        try:
            first = await asyncio.wait_for(loop.sock_recv(conn, MAX_SNIFF_BYTES), wait)
        except TimeoutError:
            if attachment.policy.mode != "open":
                raise Refusal("the client named no host in time") from None
            # A silent client (the server speaks first): connect by address; its first bytes are checked
            # when they come.
            await self._connect_nameless(attachment, relay, dialled, port)
            await self._relay(attachment, relay, b"", late_check=dialled)
            return
        if not first:
            return  # the client gave up
        buffered, name = await self._read_name(attachment, conn, first)
        if name is not None:
            relay.name = name
            await self._connect_named(attachment, relay, name, dialled, port)
        else:
            await self._connect_nameless(attachment, relay, dialled, port)
        await self._relay(attachment, relay, buffered)

    async def _check_address_of(
        self, attachment: Attachment, name: str, dialled: ipaddress.IPv4Address
    ) -> None:
        """Refuse unless ``dialled`` is an address of ``name`` (a name and an address that disagree go
        nowhere): one the upstream gives now or the resolver gave this sandbox."""
        given = attachment.addresses_given(name)
        if dialled in given:
            return
        try:
            addresses = await self.upstream.lookup(name)  # only now: most clients dial what we told them
        except LookupFailed as exc:
            if not given:
                raise Refusal(f"{name} does not resolve: {exc}") from None
            addresses = ()
        if dialled not in addresses:
            raise Refusal(f"{dialled}, the address dialled, is not an address of {name}")

    async def _connect_named(
        self, attachment: Attachment, relay: Relay, name: str, dialled: ipaddress.IPv4Address, port: int
    ) -> None:
        """Connect to ``dialled`` only if it is an address of ``name`` and of a kind the policy permits for a
        named connection."""
        await self._check_address_of(attachment, name, dialled)
        kind = self.kind_of(dialled)
        if not address_permitted(attachment.policy, kind, named=True):
            raise Refusal(f"{name} is at {dialled}, a {kind} address")
        relay.kind = kind
        await self._open(relay, dialled, port, f"{name} ({dialled}:{port})")

    async def _connect_nameless(
        self, attachment: Attachment, relay: Relay, dialled: ipaddress.IPv4Address, port: int
    ) -> None:
        if attachment.policy.mode != "open":
            raise Refusal(f"a connection to {dialled}:{port} names no host; the policy admits names only")
        kind = self.kind_of(dialled)
        if not address_permitted(attachment.policy, kind, named=False):
            raise Refusal(f"{dialled} is a {kind} address")
        relay.kind = kind
        await self._open(relay, dialled, port, f"{dialled}:{port}")

    @staticmethod
    async def _open(relay: Relay, address: Address, port: int, what: str) -> None:
        upstream = socket.socket(
            socket.AF_INET if address.version == 4 else socket.AF_INET6, socket.SOCK_STREAM
        )
        upstream.setblocking(False)
        relay.upstream = upstream
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(upstream, (str(address), port)), CONNECT_TIMEOUT_SECS
            )
        except (OSError, TimeoutError) as exc:
            raise Refusal(f"{what} could not be reached: {exc or 'timed out'}") from None

    async def _relay(
        self,
        attachment: Attachment,
        relay: Relay,
        buffered: bytes,
        late_check: ipaddress.IPv4Address | None = None,
    ) -> None:
        if not still_permitted(attachment.policy, relay):
            raise Refusal("the policy changed while connecting")  # a PATCH came in between
        attachment.relays.add(relay)
        loop = asyncio.get_running_loop()
        assert relay.upstream is not None
        for sock in (relay.client, relay.upstream):
            keep_alive(sock)  # before a wait for late first bytes too: both sides may stay silent
        if late_check is not None:
            # Nothing goes out before the first bytes are checked; the server may speak first meanwhile.
            first = await self._late_first_bytes(attachment, relay, late_check)
            if first is None:
                return
            buffered = first
        if buffered:
            await asyncio.wait_for(loop.sock_sendall(relay.upstream, buffered), CONNECT_TIMEOUT_SECS)
        splice = SpliceRelay(relay.client, relay.upstream)
        relay.on_cut = splice.stop
        await splice.wait()
        relay.close()  # both directions ended: a normal close, not a reset

    async def _late_first_bytes(
        self, attachment: Attachment, relay: Relay, connected: ipaddress.IPv4Address
    ) -> bytes | None:
        """Relay server-to-client until the client's first bytes come; they may name no host, or a permitted
        host whose addresses include the one connected to. None when the client closed first."""
        loop = asyncio.get_running_loop()
        assert relay.upstream is not None
        upstream = relay.upstream

        async def server_first() -> None:
            while data := await loop.sock_recv(upstream, 65536):
                await loop.sock_sendall(relay.client, data)

        forward = asyncio.create_task(server_first())
        try:
            first = await loop.sock_recv(relay.client, MAX_SNIFF_BYTES)
        finally:
            forward.cancel()
            await asyncio.gather(forward, return_exceptions=True)
        if not first:
            return None
        buffered, name = await self._read_name(attachment, relay.client, first)
        if name is not None:
            await self._check_address_of(attachment, name, connected)
            relay.name = name
        return buffered

    async def _read_name(
        self, attachment: Attachment, conn: socket.socket, first: bytes
    ) -> tuple[bytes, str | None]:
        """The client's bytes read until they name a host (:func:`_read_until_named`), and that name (None:
        they name none). Refused when they break the TLS or HTTP format or the name is not permitted."""
        buffered, found = await _read_until_named(conn, first, self.name_wait_secs)
        if found.verdict is Verdict.MALFORMED:
            raise Refusal(f"a malformed {found.protocol} request")
        if found.verdict is not Verdict.NAME:
            return buffered, None
        if not name_permitted(attachment.policy, found.name):
            raise Refusal(f"{found.name} is not permitted by the policy")
        return buffered, found.name


async def _read_until_named(conn: socket.socket, first: bytes, wait_secs: float) -> tuple[bytes, Sniffed]:
    """Read on until :func:`sniff` decides (at most 4 x MAX_SNIFF_BYTES in all, for ``wait_secs``)."""
    loop = asyncio.get_running_loop()
    buffered = first
    found = sniff(buffered)
    deadline = loop.time() + wait_secs
    while found.verdict is Verdict.MORE and len(buffered) < 4 * MAX_SNIFF_BYTES:
        try:
            chunk = await asyncio.wait_for(
                loop.sock_recv(conn, MAX_SNIFF_BYTES), max(0.0, deadline - loop.time())
            )
        except TimeoutError:
            break
        if not chunk:
            break
        buffered += chunk
        found = sniff(buffered)
    if found.verdict is Verdict.MORE:
        # Incomplete when the client stopped sending (or after NAME_WAIT_SECS): a started TLS hello or
        # HTTP head that never ends is malformed; other bytes name nothing.
        malformed = buffered[:1] == b"\x16" or buffered[:1].isupper()
        found = Sniffed(Verdict.MALFORMED if malformed else Verdict.NAMELESS)
    return buffered, found
