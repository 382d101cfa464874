"""Which host name a client's first bytes ask for: the TLS ClientHello's SNI or the HTTP/1 ``Host`` header.

The egress proxy (proxy.py) reads a connection's first bytes, asks :func:`sniff` what they name, and decides
by that name alone. :func:`sniff` never guesses: bytes that are neither a well-formed ClientHello nor an HTTP/1
request head are :data:`Verdict.NAMELESS`, as is a ClientHello without SNI or an HTTP request whose Host is an
address; a ClientHello or request head that breaks its own format (lengths that disagree, two SNI names, two
Host headers, a head longer than :data:`MAX_SNIFF_BYTES`) is :data:`Verdict.MALFORMED`, which the proxy always
refuses, because another parser (the server's) might read a different name out of it; bytes that could still
become one of the two are :data:`Verdict.MORE` (read more and ask again).
"""

from __future__ import annotations

import enum
import ipaddress
import re
from dataclasses import dataclass
from typing import Final

#: The most bytes read before deciding: a TLS record is at most 16 KiB plus its 5-byte header, and an
#: HTTP request head longer than this is refused rather than buffered.
MAX_SNIFF_BYTES: Final = 16 * 1024 + 5

_HTTP_METHODS: Final = (
    b"GET",
    b"POST",
    b"PUT",
    b"HEAD",
    b"DELETE",
    b"OPTIONS",
    b"PATCH",
    b"CONNECT",
    b"TRACE",
)
_TOKEN_RE: Final = re.compile(rb"[A-Z]{1,10}")
_HOST_NAME_RE: Final = re.compile(r"[a-z0-9_](?:[a-z0-9_.-]{0,251}[a-z0-9_])?")
_TLS_HANDSHAKE: Final = 0x16
_CLIENT_HELLO: Final = 0x01
_EXT_SERVER_NAME: Final = 0x0000


class Verdict(enum.Enum):
    """What the bytes so far say."""

    NAME = "name"  # a host name was found
    MORE = "more"  # incomplete: read more bytes
    NAMELESS = "nameless"  # complete, and no usable name (not TLS nor HTTP, no SNI, an address as Host)
    MALFORMED = "malformed"  # a TLS hello or HTTP head that breaks its own rules: never let through


@dataclass(frozen=True)
class Sniffed:
    """The verdict, the protocol (``tls``, ``http`` or ``""``) and the name (lowercase, no trailing dot, no
    port; set only for :data:`Verdict.NAME`)."""

    verdict: Verdict
    protocol: str = ""
    name: str = ""


_MORE: Final = Sniffed(Verdict.MORE)
_BAD_TLS: Final = Sniffed(Verdict.MALFORMED, "tls")
_BAD_HTTP: Final = Sniffed(Verdict.MALFORMED, "http")
_NAMELESS: Final = Sniffed(Verdict.NAMELESS)


def sniff(data: bytes) -> Sniffed:
    """What host name ``data`` (the first bytes a client sent) asks for; see the module docstring."""
    if not data:
        return _MORE
    if data[0] == _TLS_HANDSHAKE:
        return _sniff_tls(data)
    if data[:1].isupper():
        return _sniff_http(data)
    return _NAMELESS


def _clean_name(raw: str, protocol: str) -> Sniffed:
    name = raw.strip().lower().removesuffix(".")
    if not name or not _HOST_NAME_RE.fullmatch(name) or ".." in name:
        return Sniffed(Verdict.MALFORMED, protocol)
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return Sniffed(Verdict.NAME, protocol, name)
    return Sniffed(Verdict.NAMELESS, protocol)  # an address is no name: the connection is nameless


def _sniff_http(data: bytes) -> Sniffed:
    space = data.find(b" ", 0, 12)
    token = data[:space] if space >= 0 else data[:12]
    if space < 0:
        # Still reading the method: anything but a prefix of a known method is not HTTP.
        if len(token) < 12 and any(m.startswith(token) for m in _HTTP_METHODS):
            return _MORE
        return _NAMELESS
    if not _TOKEN_RE.fullmatch(token):
        return _NAMELESS
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return _MORE if len(data) < MAX_SNIFF_BYTES else _BAD_HTTP
    lines = data[:end].split(b"\r\n")
    hosts = [line.split(b":", 1)[1] for line in lines[1:] if line[:5].lower() == b"host:"]
    if len(hosts) > 1:
        return _BAD_HTTP  # several Host headers: an attempt to confuse
    if not hosts:
        return Sniffed(Verdict.NAMELESS, "http")  # HTTP/1.0 without Host
    try:
        value = hosts[0].decode("ascii").strip()
    except UnicodeDecodeError:
        return _BAD_HTTP
    if value.startswith("["):
        return Sniffed(Verdict.NAMELESS, "http")  # an IPv6 literal
    host, _, port = value.partition(":")
    if port and not port.isdigit():
        return _BAD_HTTP
    return _clean_name(host, "http")


class _Short(Exception):
    """The buffer ends before the structure does."""


class _Bad(Exception):
    """The structure is malformed."""


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise _Short
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def u24(self) -> int:
        return int.from_bytes(self.take(3), "big")


def _sniff_tls(data: bytes) -> Sniffed:
    """The SNI of a ClientHello, which may span several handshake records."""
    handshake = bytearray()
    pos = 0
    # Reassemble the handshake message from records until its declared length is complete.
    while True:
        if len(data) < pos + 5:
            return _MORE
        content_type, major, length = data[pos], data[pos + 1], int.from_bytes(data[pos + 3 : pos + 5], "big")
        if content_type != _TLS_HANDSHAKE or major != 3 or length == 0 or length > 16384 + 2048:
            return _BAD_TLS
        if len(data) < pos + 5 + length:
            return _MORE if pos + 5 + length <= 4 * MAX_SNIFF_BYTES else _BAD_TLS
        handshake += data[pos + 5 : pos + 5 + length]
        pos += 5 + length
        if len(handshake) >= 4:
            if handshake[0] != _CLIENT_HELLO:
                return _BAD_TLS
            total = 4 + int.from_bytes(handshake[1:4], "big")
            if len(handshake) >= total:
                break
    try:
        name = _client_hello_sni(bytes(handshake[4:total]))
    except (_Short, _Bad, UnicodeDecodeError):
        return _BAD_TLS
    if name is None:
        return Sniffed(Verdict.NAMELESS, "tls")
    return _clean_name(name, "tls")


def _client_hello_sni(body: bytes) -> str | None:
    cur = _Cursor(body)
    cur.take(2)  # legacy_version
    cur.take(32)  # random
    cur.take(cur.u8())  # session id
    suites = cur.u16()
    if suites % 2:
        raise _Bad
    cur.take(suites)
    cur.take(cur.u8())  # compression methods
    if cur.pos == len(body):
        return None  # no extensions at all
    ext_length = cur.u16()
    ext_end = cur.pos + ext_length
    if ext_end != len(body):
        raise _Bad
    names: list[str] = []
    while cur.pos < ext_end:
        ext_type = cur.u16()
        ext = _Cursor(cur.take(cur.u16()))
        if ext_type != _EXT_SERVER_NAME:
            continue
        if names:
            raise _Bad  # a second server_name extension
        list_end = ext.u16()
        if list_end != len(ext.data) - 2:
            raise _Bad
        while ext.pos < len(ext.data):
            name_type = ext.u8()
            value = ext.take(ext.u16())
            if name_type == 0:
                names.append(value.decode("ascii"))
    if len(names) > 1:
        raise _Bad  # RFC 6066: at most one host_name
    return names[0] if names else None
