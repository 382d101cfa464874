"""The puller against request forgery (issue 11, item 3): which addresses it connects to, checked when
connecting (names after DNS, literals, redirects), and error messages that never quote a server's bytes.

Servers run on loopback; a forbidden address is refused before its socket connects, so no packet leaves."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from sbx.api.errors import InvalidRequest, NotFound, Refused, SandboxError, Unavailable
from sbx.images.addresses import RegistryAddresses, RegistryAddressRefused, address_kind
from sbx.images.reference import parse_reference
from sbx.images.registry import RegistryClient
from sbx.images.remote_text import escaped, shown_host, shown_media_type, shown_platform
from sbx.net.ranges import HostAddresses

SECRET = b"HOST-SECRET"


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("169.254.169.254", "forbidden"), ("169.254.1.1", "forbidden"), ("fe80::1", "forbidden"),
        ("fd00:ec2::254", "forbidden"), ("100.100.100.200", "forbidden"), ("168.63.129.16", "forbidden"),
        ("0.0.0.0", "forbidden"), ("0.1.2.3", "forbidden"), ("::", "forbidden"), ("224.0.0.1", "forbidden"),
        ("255.255.255.255", "forbidden"), ("::ffff:169.254.169.254", "forbidden"),
        ("64:ff9b::a9fe:a9fe", "forbidden"), ("2002:a9fe:a9fe::1", "forbidden"),
        ("127.0.0.1", "private"), ("127.9.9.9", "private"), ("::1", "private"), ("::ffff:127.0.0.1", "private"),
        ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("100.64.0.1", "private"),
        ("fd12::1", "private"), ("64:ff9b::a01:203", "private"), ("2002:7f00:1::1", "private"),
        ("192.0.2.99", "private"),  # "this host's own address" in this table (see host below)
        ("1.1.1.1", "public"), ("198.51.100.10", "public"), ("2606:4700::1111", "public"),
    ],
)  # fmt: skip
def test_address_kinds(address: str, kind: str) -> None:
    assert address_kind(ipaddress.ip_address(address), host={ipaddress.ip_address("192.0.2.99")}) == kind


class FixedHost(HostAddresses):
    def get(self) -> frozenset[Any]:
        return frozenset()


@pytest.mark.parametrize(
    ("allowed", "host", "port", "address", "ok"),
    [
        ((), "1.1.1.1", 443, "1.1.1.1", True),
        ((), "127.0.0.1", 5000, "127.0.0.1", False),
        (("127.0.0.1:5000",), "127.0.0.1", 5000, "127.0.0.1", True),
        (("127.0.0.1:5000",), "127.0.0.1", 5001, "127.0.0.1", False),  # another port of a listed host
        (("127.0.0.1",), "127.0.0.1", 443, "127.0.0.1", True),  # no port: 443 and 80
        (("127.0.0.1",), "127.0.0.1", 80, "127.0.0.1", True),
        (("127.0.0.1",), "127.0.0.1", 8080, "127.0.0.1", False),
        (("mirror.lan:5000",), "mirror.lan", 5000, "10.0.0.5", True),
        (("mirror.lan:5000",), "other.lan", 5000, "10.0.0.5", False),
        (("[::1]:5000",), "::1", 5000, "::1", True),
        (("169.254.169.254", "169.254.169.254:80"), "169.254.169.254", 80, "169.254.169.254", False),  # never
    ],
)  # fmt: skip
def test_the_check(allowed: tuple[str, ...], host: str, port: int, address: str, ok: bool) -> None:
    guard = RegistryAddresses(allowed, FixedHost())
    if ok:
        guard.check(host, port, ipaddress.ip_address(address))
    else:
        with pytest.raises(RegistryAddressRefused):
            guard.check(host, port, ipaddress.ip_address(address))


async def test_the_resolver_keeps_only_the_addresses_a_name_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from sbx.net import dial_guard as addresses

    class Inner:
        async def resolve(self, host: str, port: int, family: int) -> list[dict[str, Any]]:
            table = {
                "mixed.test": ["198.51.100.7", "127.0.0.1"],
                "inside.test": ["127.0.0.1", "169.254.169.254"],
            }
            return [{"hostname": host, "host": a, "port": port, "family": socket.AF_INET, "proto": 0, "flags": 0}
                    for a in table[host]]  # fmt: skip

        async def close(self) -> None:
            pass

    monkeypatch.setattr(addresses, "DefaultResolver", Inner)
    resolver = RegistryAddresses((), FixedHost()).resolver()
    assert [r["host"] for r in await resolver.resolve("mixed.test", 443)] == ["198.51.100.7"]
    with pytest.raises(RegistryAddressRefused, match="loopback, private or this host's own address"):
        await resolver.resolve("inside.test", 443)
    listed = RegistryAddresses(("inside.test",), FixedHost()).resolver()
    assert [r["host"] for r in await listed.resolve("inside.test", 443)] == ["127.0.0.1"]  # never metadata


# -- against servers on loopback ------------------------------------------------------------------------------


class Counting:
    """A TCP server on loopback answering ``answer`` to anything; counts the connections it got."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await asyncio.wait_for(reader.read(4096), 2)
            writer.write(self.answer)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        writer.close()

    async def start(self) -> Counting:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()


@pytest.fixture
async def secret() -> AsyncIterator[Counting]:
    server = await Counting(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + SECRET).start()
    yield server
    await server.close()


async def resolve(ref: str, allowed: tuple[str, ...] = (), attempts: int = 1) -> None:
    async with RegistryClient(allow_private_registries=allowed, attempts=attempts) as client:
        await client.resolve(parse_reference(ref))


async def test_a_loopback_service_is_never_reached(secret: Counting) -> None:
    for ref in (f"127.0.0.1:{secret.port}/probe:1", f"localhost:{secret.port}/probe:1",
                f"[::ffff:127.0.0.1]:{secret.port}/probe:1"):  # fmt: skip
        with pytest.raises(Refused) as info:
            await resolve(ref, attempts=3)
        assert "allow_private_registries" in info.value.message and "HOST-SECRET" not in info.value.message
    assert secret.connections == 0


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("169.254.169.254/latest/meta:1", "link-local, metadata or reserved"),
        ("169.254.169.254:80/latest/meta:1", "link-local, metadata or reserved"),
        ("0.0.0.0:5000/x:1", "link-local, metadata or reserved"),
        ("10.20.30.40:5000/x:1", "loopback, private or this host's own address"),
        ("192.168.1.1/x:1", "loopback, private or this host's own address"),
        ("[fd00::1]:5000/x:1", "loopback, private or this host's own address"),
    ],
)
async def test_metadata_and_private_addresses_are_refused_before_connecting(ref: str, words: str) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(Refused, match=words):
        await resolve(ref, allowed=("169.254.169.254", "169.254.169.254:80"), attempts=3)
    assert loop.time() - started < 1.0  # refused at once: no connect timeout, no retries


async def test_a_listed_service_is_reached_but_its_bytes_are_not_echoed(secret: Counting) -> None:
    with pytest.raises(SandboxError) as info:
        await resolve(f"127.0.0.1:{secret.port}/probe:1", allowed=(f"127.0.0.1:{secret.port}",))
    assert secret.connections >= 1
    assert "HOST-SECRET" not in info.value.message and "SECRET" not in info.value.message


async def serve(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def test_a_redirect_to_an_unlisted_loopback_port_is_refused(secret: Counting) -> None:
    async def redirect(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(f"http://127.0.0.1:{secret.port}/v2/probe/manifests/1")

    runner, port = await serve(redirect)
    try:
        with pytest.raises(Refused, match=f"127.0.0.1:{secret.port}.*allow_private_registries"):
            await resolve(f"127.0.0.1:{port}/probe:1", allowed=(f"127.0.0.1:{port}",), attempts=3)
    finally:
        await runner.cleanup()
    assert secret.connections == 0


@pytest.mark.parametrize(
    ("status", "reason", "error", "shown"),
    [
        (404, "Not Found", NotFound, "404 Not Found"),
        (401, "Unauthorized", Refused, None),  # a 401 without a challenge
        (403, "Forbidden", Refused, "403 Forbidden"),
        (400, "Bad Request", InvalidRequest, "400 Bad Request"),
        (503, "Service Unavailable", Unavailable, "503 Service Unavailable"),
    ],
)
async def test_status_errors_show_only_the_status_line(
    status: int, reason: str, error: type[SandboxError], shown: str | None
) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        body = b'{"errors": [{"code": "DENIED", "message": "HOST-SECRET-IN-BODY"}]}'
        return web.Response(status=status, reason=reason, body=body, content_type="application/json")

    runner, port = await serve(answer)
    try:
        with pytest.raises(error) as info:
            await resolve(f"127.0.0.1:{port}/probe:1", allowed=(f"127.0.0.1:{port}",))
    finally:
        await runner.cleanup()
    assert "HOST-SECRET-IN-BODY" not in info.value.message and "DENIED" not in info.value.message
    if shown is not None:
        assert shown in info.value.message, info.value.message


async def test_a_status_line_is_shown_escaped_and_cut() -> None:
    reason = b"Bad \x1b[31mHOST" + b"x" * 100 + b"-SECRET"
    server = await Counting(b"HTTP/1.1 400 " + reason + b"\r\nContent-Length: 0\r\n\r\n").start()
    try:
        with pytest.raises(SandboxError) as info:
            await resolve(f"127.0.0.1:{server.port}/probe:1", allowed=(f"127.0.0.1:{server.port}",))
    finally:
        await server.close()
    message = info.value.message
    assert "\x1b" not in message and "SECRET" not in message, message
    assert message.endswith("answered 400 Bad \\x1b[31mHOST" + "x" * 24 + "..."), message


@pytest.mark.parametrize(
    "manifest",
    [
        pytest.param({"schemaVersion": 2, "mediaType": "application/x-HOST-SECRET", "layers": []}, id="media-type"),
        pytest.param({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                      "manifests": [{"digest": "sha256:" + "0" * 64, "size": 1,
                                     "platform": {"os": "HOST-SECRET", "architecture": "amd64"}}]}, id="platform"),
        pytest.param({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                      "config": {"digest": "HOST-SECRET", "size": "HOST-SECRET"}, "layers": []}, id="descriptor"),
    ],
)  # fmt: skip
async def test_manifest_values_are_not_quoted(manifest: dict[str, Any]) -> None:
    import json

    async def answer(request: web.Request) -> web.StreamResponse:
        return web.Response(body=json.dumps(manifest).encode(), content_type="application/json")

    runner, port = await serve(answer)
    try:
        with pytest.raises(InvalidRequest) as info:
            await resolve(f"127.0.0.1:{port}/probe:1", allowed=(f"127.0.0.1:{port}",))
    finally:
        await runner.cleanup()
    assert "SECRET" not in info.value.message, info.value.message


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("Not Found", "Not Found"),
        ("a\x00b\nc", "a\\x00b\\x0ac"),
        ("é", "\\xe9"),
        ("x" * 50, "x" * 40 + "..."),
    ],
)
def test_escaped(text: str, shown: str) -> None:
    assert escaped(text, 40) == shown


def test_shown_values() -> None:
    assert shown_media_type("application/vnd.oci.image.manifest.v1+json").endswith("v1+json")
    assert shown_media_type("text/HOST-SECRET") == "a media type this puller does not know"
    assert shown_platform("linux", "arm64", "v8") == "linux/arm64/v8"
    assert (
        shown_platform("HOST", "amd64", None) is None and shown_platform("linux", "amd64", "SECRET") is None
    )
    assert shown_host("auth.example.com:5001") == "auth.example.com:5001"
    assert shown_host("evil host/") == "a host with an invalid name"
