"""The sandboxes' DNS resolver and the upstream lookups the proxy connects by (docs/network.md, "DNS").

Every DNS query a sandbox sends (to any address, port 53, UDP or TCP) is redirected here. The answer depends
only on the asking sandbox's current policy (rules.py):

- a name the policy does not permit: NXDOMAIN, whatever the type (A, AAAA, TXT, MX, ...), and the query never
  leaves this host, so a sandbox cannot smuggle data out in the names it looks up;
- a permitted name, type A: the addresses :class:`Upstream` resolves, the very lookup the proxy connects by;
- type AAAA: an empty answer (sandboxes have IPv4 only, so clients fall back to A at once);
- any other type for a permitted name: forwarded to the upstream servers as asked.

Malformed queries, several questions or a class other than IN are answered FORMERR or REFUSED.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from dnslib import QTYPE, RCODE, RR, A, DNSError, DNSHeader, DNSQuestion, DNSRecord

from sbx.net.attachment import Attachment
from sbx.net.rules import name_permitted

log = logging.getLogger(__name__)

#: Tries to find a port free for both UDP and TCP when the caller lets the kernel choose.
PORT_TRIES = 20

#: How long one upstream server may take to answer before the next is asked, seconds.
UPSTREAM_TIMEOUT_SECS: Final = 2.0
#: Lookups are cached for their answer's smallest TTL, but never longer than this, seconds.
MAX_CACHE_SECS: Final = 60.0
#: The TTL given to sandboxes for answers of ours (NXDOMAIN, empty AAAA), seconds.
OWN_TTL_SECS: Final = 5
_MAX_CACHE_ENTRIES: Final = 4096

Server = tuple[str, int]
AttachmentLookup = Callable[[str], Attachment | None]


class LookupFailed(Exception):
    """The name could not be resolved; ``rcode`` is what to tell a sandbox that asked (NXDOMAIN for no such
    name, NOERROR for a name without IPv4 address, SERVFAIL when no upstream answered)."""

    def __init__(self, message: str, rcode: int = RCODE.SERVFAIL) -> None:
        super().__init__(message)
        self.rcode = rcode


def parse_server(value: str) -> Server:
    """``"ip"`` or ``"ip:port"`` (``"[v6]:port"`` for IPv6) as an (address, port) pair; ValueError if not."""
    text = value.strip()
    port = 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            port = int(rest.removeprefix(":"))
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        port = int(port_text)
    else:
        host = text
    ipaddress.ip_address(host)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return host, port


def system_servers(resolv_conf: Path = Path("/etc/resolv.conf")) -> tuple[Server, ...]:
    """The ``nameserver`` lines of resolv.conf (the default upstream); empty when there are none."""
    found: list[Server] = []
    try:
        text = resolv_conf.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                found.append(parse_server(parts[1].split("%", 1)[0]))
            except ValueError:
                continue
    return tuple(found)


class Upstream:
    """Asks the upstream servers, in order, falling back to the next when one does not answer in time."""

    def __init__(self, servers: tuple[Server, ...]) -> None:
        self.servers = servers
        self._cache: dict[str, tuple[float, tuple[ipaddress.IPv4Address, ...]]] = {}

    async def exchange(self, packet: bytes, *, tcp: bool = False) -> bytes:
        """Send one DNS message and return the first answer; LookupFailed when no server answers."""
        if not self.servers:
            raise LookupFailed("no upstream DNS server is configured ([network] upstream_dns)")
        for host, port in self.servers:
            try:
                if tcp:
                    return await asyncio.wait_for(_tcp_exchange(host, port, packet), UPSTREAM_TIMEOUT_SECS)
                answer = await asyncio.wait_for(_udp_exchange(host, port, packet), UPSTREAM_TIMEOUT_SECS)
                if DNSRecord.parse(answer).header.tc:
                    return await asyncio.wait_for(_tcp_exchange(host, port, packet), UPSTREAM_TIMEOUT_SECS)
                return answer
            except (OSError, TimeoutError, DNSError, asyncio.IncompleteReadError) as exc:
                log.warning(
                    "upstream DNS server failed", extra={"server": f"{host}:{port}", "error": str(exc)}
                )
        raise LookupFailed("no upstream DNS server answered")

    async def lookup(self, name: str) -> tuple[ipaddress.IPv4Address, ...]:
        """The IPv4 addresses of ``name`` (cached for the answer's TTL, at most MAX_CACHE_SECS)."""
        now = time.monotonic()
        cached = self._cache.get(name)
        if cached is not None and cached[0] > now:
            return cached[1]
        query = DNSRecord.question(name, "A")
        try:
            answer = DNSRecord.parse(await self.exchange(query.pack()))
        except DNSError as exc:
            raise LookupFailed(f"{name}: the upstream answer is malformed: {exc}") from None
        if answer.header.id != query.header.id:
            raise LookupFailed(f"{name}: upstream answered another query")
        if answer.header.rcode != RCODE.NOERROR:
            raise LookupFailed(f"{name}: {RCODE.get(answer.header.rcode)}", answer.header.rcode)
        records = [rr for rr in answer.rr if rr.rtype == QTYPE.A]
        if not records:
            raise LookupFailed(f"{name}: no IPv4 address", RCODE.NOERROR)
        addresses = tuple(ipaddress.IPv4Address(str(rr.rdata)) for rr in records)
        ttl = min(MAX_CACHE_SECS, max(1.0, float(min(rr.ttl for rr in records))))
        if len(self._cache) >= _MAX_CACHE_ENTRIES:
            self._cache.clear()
        self._cache[name] = (now + ttl, addresses)
        return addresses


async def _udp_exchange(host: str, port: int, packet: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[bytes] = loop.create_future()

    class _Client(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
            if not answered.done() and data[:2] == packet[:2]:
                answered.set_result(data)

        def error_received(self, exc: Exception) -> None:
            if not answered.done():
                answered.set_exception(exc)

    transport, _ = await loop.create_datagram_endpoint(_Client, remote_addr=(host, port))
    try:
        transport.sendto(packet)
        return await answered
    finally:
        transport.close()


async def _tcp_exchange(host: str, port: int, packet: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(struct.pack("!H", len(packet)) + packet)
        await writer.drain()
        (length,) = struct.unpack("!H", await reader.readexactly(2))
        return await reader.readexactly(length)
    finally:
        writer.close()


class Resolver:
    """The DNS server sandboxes' queries are redirected to, on UDP and TCP ``port`` of every host address
    (0: any free port; :attr:`port` holds the one bound). ``attachment_of(source_address)`` finds the asking
    sandbox, None for an address that is no sandbox's (such queries get no answer)."""

    def __init__(self, upstream: Upstream, attachment_of: AttachmentLookup) -> None:
        self.upstream = upstream
        self.attachment_of = attachment_of
        self.port = 0
        self._udp: asyncio.DatagramTransport | None = None
        #: Queries being answered (kept referenced until done).
        self._pending: set[asyncio.Task[None]] = set()
        self._tcp: asyncio.Server | None = None

    async def start(self, port: int = 0) -> None:
        loop = asyncio.get_running_loop()
        resolver = self

        class _Server(asyncio.DatagramProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
                source = str(addr[0])
                task = loop.create_task(resolver._answer_datagram(data, source, addr))
                resolver._pending.add(task)
                task.add_done_callback(resolver._pending.discard)

        # One port number for UDP and TCP. With port 0 the kernel picks a free UDP port whose TCP twin may be
        # taken by something else: then try another (a handful of tries always finds one).
        for attempt in range(PORT_TRIES if port == 0 else 1):
            udp, _ = await loop.create_datagram_endpoint(_Server, local_addr=("0.0.0.0", port))
            chosen = udp.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._serve_tcp, "0.0.0.0", chosen)
            except OSError as exc:
                udp.close()
                if exc.errno != errno.EADDRINUSE or attempt == PORT_TRIES - 1 or port != 0:
                    raise
                continue
            self._udp = udp
            self.port = chosen
            return

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()

    async def _answer_datagram(self, data: bytes, source: str, addr: tuple[str | object, int]) -> None:
        try:
            answer = await self.answer(data, source)
        except Exception:  # a bug must cost one query, never the resolver
            log.exception("resolver failure", extra={"source": source})
            return
        if answer is not None and self._udp is not None and not self._udp.is_closing():
            self._udp.sendto(answer, addr)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = str(writer.get_extra_info("peername")[0])
        try:
            while True:
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                answer = await self.answer(await reader.readexactly(length), source, tcp=True)
                if answer is None:
                    break
                writer.write(struct.pack("!H", len(answer)) + answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def answer(self, data: bytes, source: str, *, tcp: bool = False) -> bytes | None:
        """The answer to the query ``data`` from ``source``; None to stay silent (not a sandbox's address,
        or bytes that are no DNS query at all)."""
        attachment = self.attachment_of(source)
        if attachment is None:
            return None
        policy = attachment.policy
        try:
            query = DNSRecord.parse(data)
        except (DNSError, IndexError, ValueError):
            return None
        if query.header.qr or len(query.questions) != 1:
            return _reply(query, RCODE.FORMERR)
        question: DNSQuestion = query.questions[0]
        if question.qclass != 1:  # IN
            return _reply(query, RCODE.REFUSED)
        name = str(question.qname).lower().removesuffix(".")
        if not name_permitted(policy, name):
            return _reply(query, RCODE.NXDOMAIN)
        if question.qtype == QTYPE.AAAA:
            return _reply(query, RCODE.NOERROR)
        try:
            if question.qtype == QTYPE.A:
                addresses = await self.upstream.lookup(name)
                attachment.remember(name, addresses)
                reply = query.reply()
                for address in addresses:
                    reply.add_answer(RR(question.qname, QTYPE.A, rdata=A(str(address)), ttl=OWN_TTL_SECS))
                return bytes(reply.pack())
            return await self.upstream.exchange(data, tcp=tcp)
        except LookupFailed as exc:
            return _reply(query, exc.rcode)


def _reply(query: DNSRecord, rcode: int) -> bytes:
    header = DNSHeader(id=query.header.id, qr=1, aa=0, ra=1, rd=query.header.rd, rcode=rcode)
    reply = DNSRecord(header, q=query.questions[0] if len(query.questions) == 1 else None)
    return bytes(reply.pack())
