"""Loopback addresses: which names and addresses never leave this machine."""

from __future__ import annotations

import ipaddress
import re


def is_loopback(host: str) -> bool:
    """Whether ``host`` (``localhost``, an IPv4/IPv6 address, optionally in brackets) is loopback.

    127.0.0.0/8, ::1 and IPv4-mapped 127.x addresses are; any other name is not (names are not resolved).
    """
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name.lower().rstrip(".") == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


#: The characters of a host name in a Host header (letters, digits, '.', '-', '_'; lowercased first).
_HOST_NAME = re.compile(r"[a-z0-9._-]+")


def host_header_name(value: str) -> str:
    """The host of a ``Host`` header value (``host``, ``host:port``, ``[v6]`` or ``[v6]:port``), lowercased,
    without brackets or port; ``""`` when the value is anything else, so that it matches no name: a suffix after
    a bracketed address (``[::1].evil.example``, ``[::1]evil``), a port that is not digits, or characters no
    host name has are refused, never cut off. A bare IPv6 address is taken as one (clients send it)."""
    text = value.strip().lower()
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1 :] if end > 0 else "x"
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return ""
        return text[1:end] if _is_ipv6(text[1:end]) else ""
    if _is_ipv6(text):
        return text
    host, sep, port = text.partition(":")
    if (sep and not port.isdigit()) or not _HOST_NAME.fullmatch(host):
        return ""
    return host


def _is_ipv6(text: str) -> bool:
    if ":" not in text:
        return False  # every IPv6 address has two at least; a name (``localhost``) costs no parse error
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True
