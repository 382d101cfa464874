"""The resolver against hostile sandboxes (issue 11): crafted packets never reach the upstream as sent (only a
query rebuilt from the checked name and type does), and its TCP connections and pending queries are capped
and timed out. Real sockets on loopback; the upstream is a fake that records the bytes it was sent."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
from collections.abc import AsyncIterator, Callable

import pytest
from dnslib import (
    EDNS0,
    OPCODE,
    QTYPE,
    RCODE,
    RR,
    TXT,
    DNSHeader,
    DNSLabel,
    DNSQuestion,
    DNSRecord,
    EDNSOption,
)

from sbx.api.network_policy import NetworkPolicy
from sbx.net.attachment import Attachment
from sbx.net.dns import MAX_EDNS_UDP_BYTES, Resolver, Upstream, checked_name
from sbx.net.limits import EgressLimits

SANDBOX = "127.0.0.1"  # the tests' "sandbox address": they talk to the resolver over loopback
POLICY = NetworkPolicy("allowlist", ("allowed.test", "*.wild.test"))


class RecordingUpstream(Upstream):
    """Answers every forwarded query with one TXT record; keeps the packets it was sent. ``hold`` (when set)
    keeps every exchange waiting until it is set."""

    def __init__(self) -> None:
        super().__init__((("192.0.2.53", 53),))
        self.sent: list[bytes] = []
        self.hold: asyncio.Event | None = None

    async def exchange(self, packet: bytes, *, tcp: bool = False) -> bytes:
        self.sent.append(packet)
        if self.hold is not None:
            await self.hold.wait()
        query = DNSRecord.parse(packet)
        reply = query.reply()
        reply.add_answer(RR(query.q.qname, QTYPE.TXT, rdata=TXT("answer"), ttl=30))
        return bytes(reply.pack())


def resolver_for(upstream: Upstream, limits: EgressLimits | None = None) -> tuple[Resolver, Attachment]:
    attachment = Attachment("sbx_1", ipaddress.IPv4Address("10.200.0.2"), POLICY)
    return Resolver(upstream, lambda source: attachment if source == SANDBOX else None, limits), attachment


def ask(packet: bytes) -> tuple[DNSRecord | None, list[bytes]]:
    upstream = RecordingUpstream()
    resolver, _ = resolver_for(upstream)
    answer = asyncio.run(resolver.answer(packet, SANDBOX))
    return (DNSRecord.parse(answer) if answer is not None else None), upstream.sent


def question(name: DNSLabel | str, qtype: int = QTYPE.TXT, qid: int = 4242) -> DNSRecord:
    return DNSRecord(DNSHeader(id=qid, rd=1), q=DNSQuestion(name, qtype))


# -- crafted packets -----------------------------------------------------------------------------------------


def wire_query(labels: list[bytes], qtype: int, qid: int = 7) -> bytes:
    """A query written byte by byte (dnslib refuses to pack some of these names)."""
    name = b"".join(bytes([len(label)]) + label for label in labels) + b"\x00"
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", qtype, 1)


@pytest.mark.parametrize("qtype", [QTYPE.A, QTYPE.TXT, QTYPE.MX])
@pytest.mark.parametrize(
    "labels",
    [
        pytest.param([b"allowed.test"], id="dot-inside-one-label"),
        pytest.param([b"x", b"allowed.test"], id="dot-inside-a-label-under-nothing"),
        pytest.param([b"a.b", b"wild", b"test"], id="dot-inside-a-label-under-a-wildcard"),
        pytest.param([b"a\x00b", b"wild", b"test"], id="nul-in-a-label"),
        pytest.param([b"a b", b"wild", b"test"], id="space-in-a-label"),
        pytest.param([b"\xc3\xa9", b"wild", b"test"], id="not-ascii"),
        pytest.param([b"x" * 64, b"wild", b"test"], id="label-over-63-bytes"),
    ],
)
def test_a_name_that_is_no_host_name_is_refused_and_never_leaves(labels: list[bytes], qtype: int) -> None:
    answer, sent = ask(wire_query(labels, qtype))
    assert answer is not None and answer.header.rcode == RCODE.REFUSED, answer
    assert answer.header.id == 7
    assert answer.questions == [] and answer.rr == [] and answer.ar == []  # none of its bytes sent back
    assert sent == []


@pytest.mark.parametrize(
    ("labels", "name"),
    [
        ((b"Allowed", b"TEST"), "allowed.test"),
        ((b"_srv", b"_tcp", b"x-1", b"wild", b"test"), "_srv._tcp.x-1.wild.test"),
        ((b"allowed.test",), None),
        ((b"a", b"", b"test"), None),
        ((), None),
        (tuple([b"a" * 63] * 4), None),  # 255 characters: over 253
        (tuple([b"a" * 63] * 3 + [b"a" * 61]), ".".join(["a" * 63] * 3 + ["a" * 61])),  # exactly 253
    ],
)
def test_checked_name(labels: tuple[bytes, ...], name: str | None) -> None:
    assert checked_name(DNSLabel(list(labels))) == name


def test_the_upstream_gets_a_query_rebuilt_from_the_name_and_type_only() -> None:
    query = question("x.Wild.test", QTYPE.TXT, qid=4242)
    query.header.ad = query.header.cd = query.header.aa = 1
    query.add_ar(RR("smuggle.example", QTYPE.TXT, rdata=TXT("SECRET-IN-ADDITIONAL"), ttl=1))
    answer, sent = ask(query.pack() + b"TRAILING-SECRET")
    assert answer is not None and answer.header.rcode == RCODE.NOERROR
    assert answer.header.id == 4242  # the client's id, though the upstream saw another
    assert [str(rr.rdata) for rr in answer.rr] == ['"answer"']
    assert len(sent) == 1
    assert b"SECRET" not in sent[0]
    upstream = DNSRecord.parse(sent[0])
    assert (upstream.header.rd, upstream.header.ad, upstream.header.cd, upstream.header.aa) == (1, 0, 0, 0)
    assert [(str(q.qname), q.qtype, q.qclass) for q in upstream.questions] == [("x.Wild.test.", QTYPE.TXT, 1)]
    assert upstream.rr == [] and upstream.auth == [] and upstream.ar == []
    assert sent[0] == _rebuilt(upstream.header.id, b"\x01x\x04Wild\x04test\x00", QTYPE.TXT)


def _rebuilt(qid: int, wire_name: bytes, qtype: int) -> bytes:
    """The exact bytes of a rebuilt query: header with only RD, one question, nothing else."""
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + wire_name + struct.pack("!HH", qtype, 1)


def test_a_clients_edns_record_becomes_ours_without_its_options() -> None:
    query = question("allowed.test")
    query.add_ar(EDNS0(udp_len=65000, flags="do", opts=[EDNSOption(8, b"\x00\x01\x18\x00SECRET-ECS")]))
    answer, sent = ask(query.pack())
    assert answer is not None and answer.header.rcode == RCODE.NOERROR
    assert len(sent) == 1 and b"SECRET" not in sent[0]
    (opt,) = DNSRecord.parse(sent[0]).ar
    assert opt.rtype == QTYPE.OPT and opt.rclass == MAX_EDNS_UDP_BYTES and opt.ttl == 0 and opt.rdata == []


@pytest.mark.parametrize(
    ("build", "rcode"),
    [
        pytest.param(lambda q: q.add_answer(RR("allowed.test", QTYPE.TXT, rdata=TXT("x"))), RCODE.FORMERR,
                     id="answer-section"),
        pytest.param(lambda q: q.add_auth(RR("allowed.test", QTYPE.TXT, rdata=TXT("x"))), RCODE.FORMERR,
                     id="authority-section"),
        pytest.param(lambda q: setattr(q.header, "opcode", OPCODE.UPDATE), RCODE.NOTIMP, id="update"),
        pytest.param(lambda q: setattr(q.header, "opcode", OPCODE.NOTIFY), RCODE.NOTIMP, id="notify"),
        pytest.param(lambda q: setattr(q.header, "qr", 1), RCODE.FORMERR, id="a-response"),
    ],
)  # fmt: skip
def test_queries_with_more_than_a_question_are_refused_and_never_leave(
    build: Callable[[DNSRecord], object], rcode: int
) -> None:
    query = question("allowed.test")
    build(query)
    answer, sent = ask(query.pack())
    assert answer is not None and answer.header.rcode == rcode
    assert sent == []


# -- caps and timeouts ---------------------------------------------------------------------------------------


@pytest.fixture
async def tcp_resolver() -> AsyncIterator[tuple[Resolver, RecordingUpstream]]:
    upstream = RecordingUpstream()
    resolver, _ = resolver_for(upstream, EgressLimits(dns_tcp_per_sandbox=2, dns_pending_per_sandbox=3))
    resolver.tcp_idle_secs = 0.3
    resolver.tcp_io_secs = 0.3
    await resolver.start()
    yield resolver, upstream
    await resolver.close()


async def tcp_query(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str) -> DNSRecord:
    packet = question(name).pack()
    writer.write(struct.pack("!H", len(packet)) + packet)
    (length,) = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 5))
    return DNSRecord.parse(await asyncio.wait_for(reader.readexactly(length), 5))


async def closed_by_peer(reader: asyncio.StreamReader, within_secs: float = 5.0) -> bool:
    try:
        return await asyncio.wait_for(reader.read(100), within_secs) == b""
    except ConnectionResetError:
        return True


async def until(condition: Callable[[], bool], timeout_secs: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_secs
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_tcp_connections_past_the_cap_are_reset_and_slots_come_back(
    tcp_resolver: tuple[Resolver, RecordingUpstream],
) -> None:
    resolver, _ = tcp_resolver
    held = [await asyncio.open_connection(SANDBOX, resolver.port) for _ in range(2)]
    for reader, writer in held:  # both served: a query each
        assert (await tcp_query(reader, writer, "allowed.test")).header.rcode == RCODE.NOERROR
    reader, writer = await asyncio.open_connection(SANDBOX, resolver.port)
    assert await closed_by_peer(reader, 2)
    writer.close()
    assert resolver.tcp_slots.held("sbx_1") == 2
    held[0][1].close()
    await until(lambda: resolver.tcp_slots.held("sbx_1") == 1)
    reader, writer = await asyncio.open_connection(SANDBOX, resolver.port)
    assert (await tcp_query(reader, writer, "allowed.test")).header.rcode == RCODE.NOERROR
    writer.close()
    held[1][1].close()


@pytest.mark.parametrize(
    "send", [pytest.param(b"", id="nothing"), pytest.param(b"\x00\x20abc", id="half-a-query")]
)
async def test_idle_and_slow_tcp_connections_are_closed(
    tcp_resolver: tuple[Resolver, RecordingUpstream], send: bytes
) -> None:
    resolver, upstream = tcp_resolver
    reader, writer = await asyncio.open_connection(SANDBOX, resolver.port)
    writer.write(send)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await closed_by_peer(reader)
    assert loop.time() - started < 2.0
    await until(lambda: resolver.tcp_slots.held("sbx_1") == 0)
    assert upstream.sent == []
    writer.close()


async def test_udp_queries_past_the_pending_cap_are_dropped(
    tcp_resolver: tuple[Resolver, RecordingUpstream],
) -> None:
    resolver, upstream = tcp_resolver
    upstream.hold = asyncio.Event()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    for qid in range(10):
        await loop.sock_sendto(sock, question("allowed.test", qid=qid).pack(), (SANDBOX, resolver.port))
    await until(lambda: len(upstream.sent) == 3)
    await asyncio.sleep(0.1)
    assert len(upstream.sent) == 3 and resolver.pending_slots.held("sbx_1") == 3
    upstream.hold.set()
    answers = [DNSRecord.parse(await asyncio.wait_for(loop.sock_recv(sock, 4096), 5)) for _ in range(3)]
    assert sorted(a.header.id for a in answers) == [0, 1, 2]
    await until(lambda: resolver.pending_slots.held("sbx_1") == 0)
    await loop.sock_sendto(sock, question("allowed.test", qid=99).pack(), (SANDBOX, resolver.port))
    assert DNSRecord.parse(await asyncio.wait_for(loop.sock_recv(sock, 4096), 5)).header.id == 99
    sock.close()
