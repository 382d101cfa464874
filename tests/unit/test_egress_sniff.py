"""sniff.py: which host name a connection's first bytes ask for (TLS SNI, HTTP Host), and what is refused."""

from __future__ import annotations

import ssl
import struct

import pytest

from sbx.net.sniff import MAX_SNIFF_BYTES, Verdict, sniff

NAME, MORE, NAMELESS, MALFORMED = Verdict.NAME, Verdict.MORE, Verdict.NAMELESS, Verdict.MALFORMED


def real_client_hello(server_hostname: str | None) -> bytes:
    """The ClientHello Python's ssl sends (TLS 1.3 capable, several extensions)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if server_hostname is None:
        context.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = context.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        conn.do_handshake()
    return outgoing.read()


def sni_extension(*names: bytes) -> tuple[int, bytes]:
    entries = b"".join(b"\x00" + struct.pack("!H", len(n)) + n for n in names)
    return 0, struct.pack("!H", len(entries)) + entries


def hello(
    extensions: list[tuple[int, bytes]], *, ext_length_delta: int = 0, handshake_type: int = 1
) -> bytes:
    """A minimal ClientHello record with ``extensions`` ((type, body) pairs)."""
    exts = b"".join(struct.pack("!HH", t, len(body)) + body for t, body in extensions)
    body = (
        b"\x03\x03"
        + b"\x00" * 32
        + b"\x00"  # version, random, empty session id
        + struct.pack("!H", 2)
        + b"\x13\x01"  # one cipher suite
        + b"\x01\x00"  # one compression method
        + struct.pack("!H", len(exts) + ext_length_delta)
        + exts
    )
    message = bytes([handshake_type]) + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack("!H", len(message)) + message


def split_records(record: bytes, at: int) -> bytes:
    """The same handshake message carried by two records."""
    payload = record[5:]
    first, second = payload[:at], payload[at:]
    return (
        b"\x16\x03\x01"
        + struct.pack("!H", len(first))
        + first
        + b"\x16\x03\x01"
        + struct.pack("!H", len(second))
        + second
    )


REAL = real_client_hello("Allowed.Test")

TLS_CASES = [
    pytest.param(REAL, NAME, "allowed.test", id="python-client-hello"),
    pytest.param(real_client_hello("sub.allowed.test"), NAME, "sub.allowed.test", id="subdomain"),
    pytest.param(real_client_hello(None), NAMELESS, "", id="no-sni"),
    pytest.param(real_client_hello("198.51.100.20"), NAMELESS, "", id="address-is-not-sent-as-sni"),
    pytest.param(REAL[:3], MORE, "", id="partial-record-header"),
    pytest.param(REAL[:100], MORE, "", id="partial-record"),
    pytest.param(split_records(REAL, 60), NAME, "allowed.test", id="hello-over-two-records"),
    pytest.param(split_records(REAL, 60)[:70], MORE, "", id="second-record-missing"),
    pytest.param(hello([sni_extension(b"a.example")]), NAME, "a.example", id="minimal"),
    pytest.param(hello([sni_extension(b"a.example.")]), NAME, "a.example", id="trailing-dot"),
    pytest.param(hello([]), NAMELESS, "", id="no-extensions"),
    pytest.param(hello([(16, b"\x00\x03\x02h2")]), NAMELESS, "", id="alpn-only"),
    pytest.param(
        hello([sni_extension(b"a.example"), sni_extension(b"b.example")]),
        MALFORMED,
        "",
        id="two-sni-extensions",
    ),
    pytest.param(hello([sni_extension(b"a.example", b"b.example")]), MALFORMED, "", id="two-names"),
    pytest.param(
        hello([sni_extension(b"a.example")], ext_length_delta=2), MALFORMED, "", id="ext-length-long"
    ),
    pytest.param(
        hello([sni_extension(b"a.example")], ext_length_delta=-1), MALFORMED, "", id="ext-length-short"
    ),
    pytest.param(hello([(0, b"\x00\x09\x00\x00\x05a.exa")]), MALFORMED, "", id="sni-list-length-wrong"),
    pytest.param(hello([sni_extension(b"a example")]), MALFORMED, "", id="space-in-name"),
    pytest.param(hello([sni_extension(b"a..example")]), MALFORMED, "", id="empty-label"),
    pytest.param(hello([sni_extension("\u00e9.example".encode())]), MALFORMED, "", id="not-ascii"),
    pytest.param(hello([sni_extension(b"a.example")], handshake_type=2), MALFORMED, "", id="server-hello"),
    pytest.param(b"\x16\x03\x01\x00\x00", MALFORMED, "", id="empty-record"),
    pytest.param(b"\x16\x02\x00\x00\x05hello", MALFORMED, "", id="sslv2-version"),
    pytest.param(b"\x16\x03\x01\xff\xff", MALFORMED, "", id="record-too-long"),
]

HTTP_CASES = [
    pytest.param(b"GET / HTTP/1.1\r\nHost: Allowed.Test\r\n\r\n", NAME, "allowed.test", id="get"),
    pytest.param(
        b"POST /x HTTP/1.1\r\nContent-Length: 0\r\nhost: a.example:8080\r\n\r\n",
        NAME,
        "a.example",
        id="lowercase-header-and-port",
    ),
    pytest.param(b"GET / HTTP/1.1\r\nHost:a.example.\r\n\r\n", NAME, "a.example", id="no-space-trailing-dot"),
    pytest.param(b"G", MORE, "", id="method-prefix"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: a.exa", MORE, "", id="head-incomplete"),
    pytest.param(b"GET / HTTP/1.0\r\n\r\n", NAMELESS, "", id="http10-without-host"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: 198.51.100.20\r\n\r\n", NAMELESS, "", id="host-is-an-address"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: [2001:db8::1]:80\r\n\r\n", NAMELESS, "", id="host-is-ipv6"),
    pytest.param(
        b"GET / HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n\r\n", MALFORMED, "", id="two-hosts"
    ),
    pytest.param(b"GET / HTTP/1.1\r\nHost: a.example:http\r\n\r\n", MALFORMED, "", id="port-not-numeric"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", MALFORMED, "", id="space-in-host"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: \xc3\xa9.example\r\n\r\n", MALFORMED, "", id="host-not-ascii"),
    pytest.param(b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_SNIFF_BYTES, MALFORMED, "", id="head-too-long"),
    pytest.param(b"get / HTTP/1.1\r\nHost: a.example\r\n\r\n", NAMELESS, "", id="lowercase-method"),
    pytest.param(b"SSH-2.0-OpenSSH_9.2\r\n", NAMELESS, "", id="ssh"),
    pytest.param(b"\x00\x01\x02", NAMELESS, "", id="binary"),
    pytest.param(b"", MORE, "", id="nothing-yet"),
]


@pytest.mark.parametrize(("data", "verdict", "name"), TLS_CASES + HTTP_CASES)
def test_sniff(data: bytes, verdict: Verdict, name: str) -> None:
    found = sniff(data)
    assert (found.verdict, found.name) == (verdict, name)


def test_every_prefix_of_a_hello_asks_for_more_and_never_misreads() -> None:
    for end in range(len(REAL)):
        assert sniff(REAL[:end]).verdict is MORE, end


def test_bytes_after_the_hello_do_not_matter() -> None:
    assert sniff(REAL + b"\x17\x03\x03\x00\x05hello").name == "allowed.test"
