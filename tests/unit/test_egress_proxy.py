"""proxy.py on loopback, without nftables: a proxy whose "dialled address" is given by the test, a fake
upstream resolver and a local echo server standing for the outside host."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator, Callable

import pytest

from sbx.api.network_policy import NetworkPolicy
from sbx.net import proxy as proxy_module
from sbx.net.attachment import Attachment
from sbx.net.dns import LookupFailed, Upstream
from sbx.net.proxy import EgressProxy
from sbx.net.ranges import Address, Kind

SERVER = ipaddress.IPv4Address("127.0.0.1")
ELSEWHERE = ipaddress.IPv4Address("127.0.0.2")
HELLO_ALLOWED = b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"


class Zone(Upstream):
    def __init__(self) -> None:
        super().__init__(())

        self.asked: list[str] = []

    async def lookup(self, name: str) -> tuple[ipaddress.IPv4Address, ...]:
        self.asked.append(name)
        table = {"allowed.test": (SERVER,), "denied.test": (SERVER,), "elsewhere.test": (ELSEWHERE,)}
        if name not in table:
            raise LookupFailed(f"{name}: NXDOMAIN")
        return table[name]


class LoopbackProxy(EgressProxy):
    """Every connection "dialled" ``target``; loopback counts as public here."""

    target: tuple[ipaddress.IPv4Address, int] = (SERVER, 0)

    def dialled(self, conn: socket.socket) -> tuple[ipaddress.IPv4Address, int]:
        return self.target

    def kind_of(self, address: Address) -> Kind:
        return "public"


class Setup:
    def __init__(self, proxy: LoopbackProxy, attachment: Attachment, server_port: int) -> None:
        self.proxy = proxy
        self.attachment = attachment
        self.server_port = server_port

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.proxy.port)


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    attachment = Attachment(
        "sbx_test", SERVER, NetworkPolicy("allowlist", ("allowed.test", "elsewhere.test"))
    )
    proxy = LoopbackProxy(Zone(), lambda source: attachment, ipaddress.IPv4Network("10.200.0.0/16"))
    proxy.target = (SERVER, port)
    proxy.name_wait_secs = 0.5
    await proxy.start()
    yield Setup(proxy, attachment, port)
    await proxy.close()
    server.close()


async def reset_or_closed(reader: asyncio.StreamReader) -> bool:
    """True when the proxy reset (or closed) the connection without relaying anything."""
    try:
        data = await asyncio.wait_for(reader.read(100), 5)
    except ConnectionResetError:
        return True
    return data == b""


async def test_an_incomplete_head_is_reset_after_the_name_wait(setup: Setup) -> None:
    reader, writer = await setup.connect()
    writer.write(b"GET / HTTP/1.1\r\nHost: allowed.te")
    assert await reset_or_closed(reader)
    writer.close()


async def test_a_permitted_name_is_relayed(setup: Setup) -> None:
    reader, writer = await setup.connect()
    writer.write(HELLO_ALLOWED)
    assert await asyncio.wait_for(reader.readexactly(len(HELLO_ALLOWED)), 5) == HELLO_ALLOWED
    writer.write(b"more")
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"more"
    writer.close()


@pytest.mark.parametrize(
    "first_bytes",
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: denied.test\r\n\r\n", id="name-not-allowed"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n", id="address-not-the-names"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: nowhere.test\r\n\r\n", id="name-does-not-resolve"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", id="nameless"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: a\r\nHost: allowed.test\r\n\r\n", id="malformed"),
        pytest.param(b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00", id="malformed-tls"),
    ],
)
async def test_refusals_are_resets(setup: Setup, first_bytes: bytes) -> None:
    reader, writer = await setup.connect()
    writer.write(first_bytes)
    assert await reset_or_closed(reader)
    writer.close()


async def test_a_silent_client_is_reset_under_allowlist(setup: Setup) -> None:
    setup.attachment.policy = NetworkPolicy("allowlist", ("allowed.test",))
    reader, writer = await setup.connect()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await reset_or_closed(reader)
    assert loop.time() - started >= 0.45  # reset after the name wait, not before
    writer.close()


async def test_set_policy_cuts_what_it_no_longer_permits(setup: Setup) -> None:
    reader, writer = await setup.connect()
    writer.write(HELLO_ALLOWED)
    await asyncio.wait_for(reader.readexactly(len(HELLO_ALLOWED)), 5)
    assert setup.attachment.set_policy(NetworkPolicy("allowlist", ("allowed.test",))) == 0  # still permitted
    assert setup.attachment.set_policy(NetworkPolicy("open", None, ("allowed.test",))) == 1
    assert await reset_or_closed(reader)
    writer.close()


@pytest.mark.parametrize("cap", ["per_sandbox", "total"])
async def test_a_connection_past_a_cap_is_reset_and_the_slot_comes_back(setup: Setup, cap: str) -> None:
    slots = setup.proxy.slots
    setattr(slots, cap, 1)
    held_reader, held_writer = await setup.connect()
    held_writer.write(HELLO_ALLOWED)
    assert await asyncio.wait_for(held_reader.readexactly(len(HELLO_ALLOWED)), 5) == HELLO_ALLOWED
    assert slots.held("sbx_test") == 1 and slots.in_use == 1
    reader, writer = await setup.connect()
    writer.write(HELLO_ALLOWED)
    assert await reset_or_closed(reader)
    writer.close()
    held_writer.close()
    await until(lambda: slots.in_use == 0)
    reader, writer = await setup.connect()  # the relay that ended gave its slot back
    writer.write(HELLO_ALLOWED)
    assert await asyncio.wait_for(reader.readexactly(len(HELLO_ALLOWED)), 5) == HELLO_ALLOWED
    writer.close()


async def until(condition: Callable[[], bool], timeout_secs: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_secs
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("name", "given"),
    [
        pytest.param("elsewhere.test", SERVER, id="upstream-moved-on"),
        pytest.param("gone.test", SERVER, id="upstream-fails"),
    ],
)
async def test_an_address_the_resolver_gave_is_the_names_without_asking_again(
    setup: Setup, name: str, given: ipaddress.IPv4Address
) -> None:
    setup.attachment.policy = NetworkPolicy("allowlist", (name,))
    setup.attachment.remember(name, [given])
    hello = f"GET / HTTP/1.1\r\nHost: {name}\r\n\r\n".encode()
    reader, writer = await setup.connect()
    writer.write(hello)
    assert await asyncio.wait_for(reader.readexactly(len(hello)), 5) == hello
    writer.close()
    assert isinstance(setup.proxy.upstream, Zone) and setup.proxy.upstream.asked == []


async def test_an_address_neither_given_nor_the_upstreams_is_refused(setup: Setup) -> None:
    setup.attachment.remember("elsewhere.test", [ELSEWHERE])
    reader, writer = await setup.connect()
    writer.write(b"GET / HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n")
    assert await reset_or_closed(reader)
    writer.close()
    assert isinstance(setup.proxy.upstream, Zone) and setup.proxy.upstream.asked == ["elsewhere.test"]


def test_keep_alive_notices_a_vanished_peer_within_two_minutes() -> None:
    with socket.socket() as sock:
        proxy_module.keep_alive(sock)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        interval = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        probes = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
    assert idle + interval * probes <= 120
