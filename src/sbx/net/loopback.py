"""Loopback addresses: which names and addresses never leave this machine."""

from __future__ import annotations

import ipaddress


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


def host_header_name(value: str) -> str:
    """The host part of a ``Host`` header value, lowercased, without brackets or port."""
    name = value.strip().lower()
    if name.startswith("["):
        return name[1 : name.find("]")] if "]" in name else name[1:]
    return name.rsplit(":", 1)[0] if name.count(":") == 1 else name
