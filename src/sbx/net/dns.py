"""The sandboxes' DNS resolver and the upstream lookups the proxy connects by (docs/network.md, "DNS").

Every DNS query a sandbox sends (to any address, port 53, UDP or TCP) is redirected here. The answer depends
only on the asking sandbox's current policy (rules.py):

- a name the policy does not permit: NXDOMAIN, whatever the type (A, AAAA, TXT, MX, ...), and the query never
  leaves this host, so a sandbox cannot smuggle data out in the names it looks up;
- a permitted name, type A: the addresses :class:`Upstream` resolves, the very lookup the proxy connects by;
- type AAAA: an empty answer (sandboxes have IPv4 only, so clients fall back to A at once);
- any other type for a permitted name: forwarded to the upstream servers, as a query rebuilt from the checked
  name and type (:func:`upstream_query`), never the client's bytes.

Malformed queries, several questions, records in the answer or authority sections, an opcode other than
QUERY, a class other than IN, or a name that is no host name (:func:`checked_name`: a dot or a NUL inside a
label, ...) are answered FORMERR, NOTIMP or REFUSED, and nothing leaves the host. TCP connections and queries
being answered are capped per sandbox and in all (:class:`~sbx.net.limits.EgressLimits`).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import re
import secrets
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from dnslib import EDNS0, OPCODE, QTYPE, RCODE, RR, A, DNSError, DNSHeader, DNSLabel, DNSQuestion, DNSRecord

from sbx.logratelimit import RateLimitFilter
from sbx.net.accept import accept_forever, listen_tcp
from sbx.net.attachment import Attachment, reset
from sbx.net.limits import EgressLimits
from sbx.net.rules import name_permitted

log = logging.getLogger(__name__)
log.addFilter(RateLimitFilter())  # failures and refusals repeat once per query or connection

#: Tries to find a port free for both UDP and TCP when the caller lets the kernel choose.
PORT_TRIES = 20

#: How long one upstream server may take to answer before the next is asked, seconds.
UPSTREAM_TIMEOUT_SECS: Final = 2.0
#: Lookups are cached for their answer's smallest TTL, but never longer than this, seconds.
MAX_CACHE_SECS: Final = 60.0
#: The TTL given to sandboxes for answers of ours (NXDOMAIN, empty AAAA), seconds.
OWN_TTL_SECS: Final = 5
_MAX_CACHE_ENTRIES: Final = 4096
#: A resolver TCP connection is closed after this long without a query, seconds (RFC 7766 asks for a
#: few seconds; clients open a new one when they need it).
TCP_IDLE_SECS: Final = 10.0
#: Reading a query once its length came, or writing an answer, may take this long, seconds.
TCP_IO_SECS: Final = 5.0
#: The largest UDP answer size passed on from a client's EDNS record, bytes (the DNS flag day 2020 value).
MAX_EDNS_UDP_BYTES: Final = 1232
#: The longest name asked about, characters without the final dot (RFC 1035: 255 octets on the wire).
MAX_NAME_CHARS: Final = 253
_LABEL: Final = re.compile(rb"[A-Za-z0-9_-]{1,63}")

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
    sandbox, None for an address that is no sandbox's (such queries get no answer).

    ``limits`` caps the TCP connections and the UDP queries being answered, per sandbox and in all
    (docs/network.md, "Limits"): a connection past a cap is reset at once, a datagram past one is dropped
    (the client asks again, as from any busy server).
    """

    def __init__(
        self, upstream: Upstream, attachment_of: AttachmentLookup, limits: EgressLimits | None = None
    ) -> None:
        self.upstream = upstream
        self.attachment_of = attachment_of
        self.port = 0
        limits = limits or EgressLimits()
        #: TCP connections held, per sandbox.
        self.tcp_slots = limits.dns_tcp_slots()
        #: UDP queries being answered, per sandbox.
        self.pending_slots = limits.dns_pending_slots()
        #: See TCP_IDLE_SECS (attributes so that tests need not wait that long).
        self.tcp_idle_secs = TCP_IDLE_SECS
        self.tcp_io_secs = TCP_IO_SECS
        self._udp: asyncio.DatagramTransport | None = None
        #: Queries and TCP connections being answered (kept referenced until done).
        self._pending: set[asyncio.Task[None]] = set()
        self._tcp: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None

    async def start(self, port: int = 0) -> None:
        loop = asyncio.get_running_loop()
        resolver = self

        class _Server(asyncio.DatagramProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
                resolver._datagram(loop, data, addr)

        # One port number for UDP and TCP. With port 0 the kernel picks a free UDP port whose TCP twin may be
        # taken by something else: then try another (a handful of tries always finds one).
        for attempt in range(PORT_TRIES if port == 0 else 1):
            udp, _ = await loop.create_datagram_endpoint(_Server, local_addr=("0.0.0.0", port))
            chosen = udp.get_extra_info("sockname")[1]
            try:
                self._tcp = listen_tcp(chosen, backlog=128)
            except OSError as exc:
                udp.close()
                if exc.errno != errno.EADDRINUSE or attempt == PORT_TRIES - 1 or port != 0:
                    raise
                continue
            self._udp = udp
            self.port = chosen
            self._accepting = loop.create_task(accept_forever(self._tcp, self._accepted, "DNS resolver"))
            return

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._accepting is not None:
            self._accepting.cancel()
        if self._tcp is not None:
            self._tcp.close()
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)

    def _datagram(self, loop: asyncio.AbstractEventLoop, data: bytes, addr: tuple[str | object, int]) -> None:
        """A UDP query: answered in a task of its own, unless it is no sandbox's or past the caps."""
        source = str(addr[0])
        attachment = self.attachment_of(source)
        if attachment is None:
            return
        if not self.pending_slots.acquire(attachment.sandbox_id):
            log.warning(
                "DNS query limit reached; query dropped",
                extra={
                    "sandbox": attachment.sandbox_id,
                    "pending": self.pending_slots.held(attachment.sandbox_id),
                },
            )
            return
        self._keep(loop.create_task(self._answer_datagram(attachment, data, addr)))

    def _keep(self, task: asyncio.Task[None]) -> None:
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _answer_datagram(
        self, attachment: Attachment, data: bytes, addr: tuple[str | object, int]
    ) -> None:
        try:
            answer = await self._answer(attachment, data)
        except Exception:  # a bug must cost one query, never the resolver
            log.exception("resolver failure", extra={"sandbox": attachment.sandbox_id})
            return
        finally:
            self.pending_slots.release(attachment.sandbox_id)
        if answer is not None and self._udp is not None and not self._udp.is_closing():
            self._udp.sendto(answer, addr)

    def _accepted(self, conn: socket.socket, peer: str) -> None:
        """Serve a new TCP connection, or reset it at once when it is no sandbox's or past a cap."""
        attachment = self.attachment_of(peer)
        if attachment is None or not self.tcp_slots.acquire(attachment.sandbox_id):
            if attachment is not None:
                log.warning(
                    "DNS over TCP connection limit reached; connection reset",
                    extra={"sandbox": attachment.sandbox_id, "connections": self.tcp_slots.held(attachment.sandbox_id),
                           "all_connections": self.tcp_slots.in_use},
                )  # fmt: skip
            reset(conn)
            return
        self._keep(asyncio.get_running_loop().create_task(self._serve_tcp(conn, attachment)))

    async def _serve_tcp(self, conn: socket.socket, attachment: Attachment) -> None:
        """Queries over one TCP connection, one at a time (RFC 7766 framing: a 2-byte length, then the
        message). Closed after ``tcp_idle_secs`` without a query, or when a query or its answer takes over
        ``tcp_io_secs`` to read or write. Gives its slot back when done."""
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
            while True:
                header = await asyncio.wait_for(reader.readexactly(2), self.tcp_idle_secs)
                (length,) = struct.unpack("!H", header)
                query = await asyncio.wait_for(reader.readexactly(length), self.tcp_io_secs)
                answer = await self._answer(attachment, query, tcp=True)
                if answer is None:
                    break
                writer.write(struct.pack("!H", len(answer)) + answer)
                await asyncio.wait_for(writer.drain(), self.tcp_io_secs)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        except Exception:  # a bug must cost one connection, never the resolver
            log.exception("resolver failure", extra={"sandbox": attachment.sandbox_id})
        finally:
            self.tcp_slots.release(attachment.sandbox_id)
            if writer is not None:
                writer.transport.abort()  # at once: an answer the client does not read must not hold it
            else:
                conn.close()

    async def answer(self, data: bytes, source: str, *, tcp: bool = False) -> bytes | None:
        """The answer to the query ``data`` from ``source``; None to stay silent (not a sandbox's address,
        or bytes that are no DNS query at all)."""
        attachment = self.attachment_of(source)
        if attachment is None:
            return None
        return await self._answer(attachment, data, tcp=tcp)

    async def _answer(self, attachment: Attachment, data: bytes, *, tcp: bool = False) -> bytes | None:
        policy = attachment.policy
        try:
            query = DNSRecord.parse(data)
        except (DNSError, IndexError, ValueError, UnicodeError):
            return None
        if query.header.qr or len(query.questions) != 1 or query.rr or query.auth:
            return _reply(query, RCODE.FORMERR)
        if query.header.opcode != OPCODE.QUERY:
            return _reply(query, RCODE.NOTIMP)
        question: DNSQuestion = query.questions[0]
        if question.qclass != 1:  # IN
            return _reply(query, RCODE.REFUSED)
        name = checked_name(question.qname)
        if name is None:
            return _reply(query, RCODE.REFUSED)
        if not name_permitted(policy, name):
            return _reply(query, RCODE.NXDOMAIN)
        if question.qtype == QTYPE.AAAA:
            return _reply(query, RCODE.NOERROR)
        try:
            if question.qtype == QTYPE.A:
                addresses = await self.upstream.lookup(name)
                attachment.remember(name, addresses)
                reply = _reply_record(query)
                for address in addresses:
                    reply.add_answer(RR(question.qname, QTYPE.A, rdata=A(str(address)), ttl=OWN_TTL_SECS))
                return bytes(reply.pack())
            answer = await self.upstream.exchange(upstream_query(query), tcp=tcp)
            # The upstream answered our query, under its id: give the client its own id back.
            return int(query.header.id).to_bytes(2, "big") + answer[2:]
        except LookupFailed as exc:
            return _reply(query, exc.rcode)


def checked_name(qname: DNSLabel) -> str | None:
    """The host name a question asks for, lowercase without the final dot; None when it is no host name: a
    label holding anything but letters, digits, ``-`` and ``_`` (a dot inside a label, a NUL, ...), an empty
    or over-long label or name. Only such names are ever matched against a policy or sent upstream."""
    labels = qname.label
    if not labels:
        return None
    text: list[str] = []
    for label in labels:
        if not _LABEL.fullmatch(label):
            return None
        text.append(label.decode("ascii").lower())
    name = ".".join(text)
    return name if len(name) <= MAX_NAME_CHARS else None


def upstream_query(query: DNSRecord) -> bytes:
    """The query sent upstream for ``query``, whose name passed :func:`checked_name`: rebuilt from the name's
    labels (their case kept, for clients that check it) and the type alone, under a fresh id, never the
    client's bytes. Only the recursion-desired flag is kept; a client's EDNS record becomes ours, with its
    UDP size (512 to MAX_EDNS_UDP_BYTES) and no options or flags."""
    question: DNSQuestion = query.questions[0]
    header = DNSHeader(id=secrets.randbits(16), qr=0, opcode=OPCODE.QUERY, rd=query.header.rd)
    rebuilt = DNSRecord(header, q=DNSQuestion(DNSLabel(list(question.qname.label)), question.qtype, 1))
    opt = next((rr for rr in query.ar if rr.rtype == QTYPE.OPT), None)
    if opt is not None:
        rebuilt.add_ar(EDNS0(udp_len=max(512, min(int(opt.rclass), MAX_EDNS_UDP_BYTES))))
    return bytes(rebuilt.pack())


def _reply_record(query: DNSRecord) -> DNSRecord:
    """An empty NOERROR answer to ``query``, echoing only its id, recursion flag and question; the question
    only when it is one host name (:func:`checked_name`): other bytes of the client's are never sent back."""
    header = DNSHeader(id=query.header.id, qr=1, aa=0, ra=1, rd=query.header.rd)
    single = len(query.questions) == 1 and checked_name(query.questions[0].qname) is not None
    return DNSRecord(header, q=query.questions[0] if single else None)


def _reply(query: DNSRecord, rcode: int) -> bytes:
    reply = _reply_record(query)
    reply.header.rcode = rcode
    return bytes(reply.pack())
