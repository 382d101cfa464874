"""Which addresses the image puller may connect to (docs/images.md, "Registries on private addresses").

An image reference names a host, and whoever may create a sandbox chooses the reference: without a check,
``127.0.0.1:8080/x`` or ``169.254.169.254/x`` would make sandboxd send requests to services of this host or
its cloud that nobody else can reach. Three kinds of addresses:

- ``forbidden``, never connected to: link-local (169.254.0.0/16, fe80::/10) and the cloud metadata services
  that live elsewhere (fd00:ec2::254, 100.100.100.200, 168.63.129.16), unspecified (0.0.0.0/8, which Linux
  connects to this host, and ::), multicast, broadcast and reserved ranges;
- ``private``: loopback, this host's own addresses, RFC 1918, shared (100.64.0.0/10) and unique-local
  ranges: connected to only for a registry the operator listed in ``[images] allow_private_registries``;
- ``public``: everything else.

IPv4-mapped, NAT64 and 6to4 IPv6 addresses are judged by the IPv4 address they carry.

The check happens when connecting, on the address connected to: :class:`RegistryAddresses` gives aiohttp a
resolver that drops the addresses a name may not use (a name resolving to loopback is refused, the addresses
are never looked up twice) and a socket factory that refuses a forbidden or unlisted private address before
the socket connects (an address literal in a reference, or a redirect to one, never reaches the resolver).
Every connection of the puller goes through both: registry, token server, and every redirect.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from typing import Any, Final, Literal

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from sbx.net.ranges import Address, HostAddresses

Kind = Literal["forbidden", "private", "public"]

_FORBIDDEN: Final = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4", "100.100.100.200/32", "168.63.129.16/32",
        "::/128", "fe80::/10", "ff00::/8", "fd00:ec2::254/128",
    )
)  # fmt: skip
_PRIVATE: Final = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "192.0.0.0/24",
        "198.18.0.0/15", "::1/128", "fc00::/7", "fec0::/10",
    )
)  # fmt: skip
_NAT64: Final = ipaddress.ip_network("64:ff9b::/96")
_SIX_TO_FOUR: Final = ipaddress.ip_network("2002::/16")
#: Ports a listed registry without one may be reached on (HTTPS, and HTTP for an insecure registry).
DEFAULT_PORTS: Final = (443, 80)


def embedded_ipv4(address: Address) -> Address:
    """The IPv4 address an IPv4-mapped, NAT64 or 6to4 IPv6 address carries; ``address`` otherwise."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if address.sixtofour is not None:
            return address.sixtofour
    return address


def address_kind(address: Address, host: Iterable[Address] = ()) -> Kind:
    """The kind of ``address`` for the puller (see the module docstring); ``host``: this host's own."""
    address = embedded_ipv4(address)
    for net in _FORBIDDEN:
        if address.version == net.version and address in net:
            return "forbidden"
    if address in host:
        return "private"
    for net in _PRIVATE:
        if address.version == net.version and address in net:
            return "private"
    return "public"


class RegistryAddressRefused(OSError):
    """The puller may not connect to this address; the message says why and what to change."""


def split_host_port(entry: str) -> tuple[str, int | None]:
    """``host[:port]`` (``[v6]:port`` for IPv6) as (lowercase host without brackets, port or None)."""
    text = entry.strip().lower()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, int(port) if port.isdigit() else None
    return text, None


class RegistryAddresses:
    """The puller's connection guard. ``allow_private`` lists ``host[:port]`` entries that may be on private
    addresses (a name, or an address literal; without a port, ports 443 and 80). ``host_addresses`` are this
    host's own addresses (read from the kernel by default)."""

    def __init__(
        self, allow_private: Iterable[str] = (), host_addresses: HostAddresses | None = None
    ) -> None:
        self._allowed: set[tuple[str, int]] = set()
        for entry in allow_private:
            host, port = split_host_port(entry)
            self._allowed.update((host, p) for p in ((port,) if port is not None else DEFAULT_PORTS))
        self._host = host_addresses or HostAddresses()
        #: Private (address, port) pairs the resolver gave out for a listed name: the socket factory lets
        #: them through.
        self._resolved: set[tuple[Address, int]] = set()

    def allows_private(self, host: str, port: int) -> bool:
        """Whether ``host`` (a name or an address, as a URL spells it) on ``port`` is listed."""
        return (split_host_port(host)[0], port) in self._allowed

    def check(self, host: str, port: int, address: Address) -> None:
        """Raise RegistryAddressRefused unless the puller may connect to ``address``:``port`` for ``host``."""
        kind = address_kind(address, self._host.get())
        if kind == "public":
            return
        if kind == "forbidden":
            raise RegistryAddressRefused(
                f"{host}:{port} is at {address}, a link-local, metadata or reserved address, which image "
                "pulls never connect to"
            )
        if not self.allows_private(host, port) and (address, port) not in self._resolved:
            raise RegistryAddressRefused(
                f"{host}:{port} is at {address}, a loopback, private or this host's own address; list "
                f"{_entry(host, port)} in [images] allow_private_registries to pull from it"
            )

    def resolver(self) -> AbstractResolver:
        """An aiohttp resolver that keeps only the addresses a name may be connected to."""
        return _GuardedResolver(self)

    def socket_factory(self, addr_info: tuple[Any, ...]) -> socket.socket:
        """aiohttp's ``socket_factory``: a socket for ``addr_info`` once its address passed the check."""
        family, type_, proto, _, sockaddr = addr_info
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        self.check(str(address), int(sockaddr[1]), address)
        return socket.socket(family, type_, proto)

    def _remember(self, address: Address, port: int) -> None:
        if len(self._resolved) >= 4096:
            self._resolved.clear()  # names of listed registries only: a handful; never grows past this
        self._resolved.add((address, port))


class _GuardedResolver(AbstractResolver):
    def __init__(self, guard: RegistryAddresses) -> None:
        self._guard = guard
        self._inner = DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        kept: list[ResolveResult] = []
        refusals: list[str] = []
        for result in results:
            address = ipaddress.ip_address(str(result["host"]).split("%", 1)[0])
            try:
                self._guard.check(host, port, address)
            except RegistryAddressRefused as exc:
                refusals.append(str(exc))
                continue
            if address_kind(address, self._guard._host.get()) == "private":
                self._guard._remember(address, port)
            kept.append(result)
        if not kept:
            raise RegistryAddressRefused(refusals[0] if refusals else f"{host} has no address")
        return kept

    async def close(self) -> None:
        await self._inner.close()


def _entry(host: str, port: int) -> str:
    host = f"[{host}]" if ":" in host else host
    return host if port == 443 else f"{host}:{port}"
