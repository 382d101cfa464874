"""Which destination addresses a sandbox may reach (docs/network.md, "Forbidden ranges").

Three kinds:

- ``forbidden``: never, whatever the policy: this host's own addresses, loopback, link-local (169.254.0.0/16,
  where cloud metadata services live, and fe80::/10), multicast, broadcast, unspecified and reserved ranges,
  and the sandbox subnet (other sandboxes).
- ``private``: RFC 1918, shared address space (100.64.0.0/10), unique-local IPv6 and the like: only when the
  connection's name matched an entry of an ``allowlist`` policy's ``allow`` list, that is when someone
  explicitly named a host living there. Never under ``open`` and never for a connection without a name.
- ``public``: everything else (documentation and benchmarking ranges included: they are not routed on the
  internet, so a host using them is one somebody set up deliberately).
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Collection, Iterable
from typing import Final, Literal

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Kind = Literal["forbidden", "private", "public"]

_FORBIDDEN: Final[tuple[Network, ...]] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4",
        "::/128", "::1/128", "fe80::/10", "ff00::/8", "::ffff:0:0/96", "64:ff9b::/96", "2002::/16",
    )
)  # fmt: skip
_PRIVATE: Final[tuple[Network, ...]] = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "192.0.0.0/24", "fc00::/7")
)

#: How long the host's own address list is trusted before being read again, seconds.
HOST_ADDRESSES_TTL_SECS: Final = 10.0


def classify(
    address: Address, extra_forbidden: Iterable[Network] = (), host: Collection[Address] = ()
) -> Kind:
    """The kind of ``address`` (see the module docstring). ``extra_forbidden``: the sandbox subnet;
    ``host``: this host's own addresses (best a set: it is searched on every connection)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address in host:
        return "forbidden"
    for net in (*_FORBIDDEN, *extra_forbidden):
        if address.version == net.version and address in net:
            return "forbidden"
    for net in _PRIVATE:
        if address.version == net.version and address in net:
            return "private"
    return "public"


class HostAddresses:
    """This host's own interface addresses (all namespaces' views are not needed: only the host's own),
    re-read at most every :data:`HOST_ADDRESSES_TTL_SECS`."""

    def __init__(self) -> None:
        self._addresses: frozenset[Address] = frozenset()
        self._read_at = -HOST_ADDRESSES_TTL_SECS

    def get(self) -> frozenset[Address]:
        now = time.monotonic()
        if now - self._read_at >= HOST_ADDRESSES_TTL_SECS:
            self._addresses = read_host_addresses()
            self._read_at = now
        return self._addresses


def read_host_addresses() -> frozenset[Address]:
    """Every address local to this host: IPv4 from /proc/net/fib_trie (its ``host LOCAL`` entries), IPv6 from
    /proc/net/if_inet6. File reads only (about 0.2 ms), so the proxy can call it on the event loop."""
    found: set[Address] = set()
    try:
        with open("/proc/net/fib_trie", encoding="ascii") as f:
            previous = ""
            for line in f:
                if "/32 host LOCAL" in line and "|--" in previous:
                    found.add(ipaddress.IPv4Address(previous.split("|--", 1)[1].strip()))
                previous = line
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            for line in f:
                raw = line.split(" ", 1)[0]
                found.add(ipaddress.IPv6Address(int(raw, 16)))
    except (OSError, ValueError):
        pass
    return frozenset(found)
