"""A connect-time guard for outgoing HTTP requests whose destination a client chose (an image reference, a job's
``notify`` URL): which addresses such a request may reach, checked on the address actually dialled.

Without it, a name chosen by a client could point at services of this host or its cloud that nobody else can
reach (``127.0.0.1``, ``169.254.169.254``), and checking the name once before connecting is not enough: DNS may
answer differently the second time (rebinding). Three kinds of addresses:

- ``forbidden``: link-local (169.254.0.0/16, fe80::/10) and the cloud metadata services that live elsewhere
  (fd00:ec2::254, 100.100.100.200, 168.63.129.16), unspecified (0.0.0.0/8, which Linux connects to this host,
  and ::), multicast, broadcast and reserved ranges;
- ``private``: loopback, this host's own addresses, RFC 1918, shared (100.64.0.0/10) and unique-local ranges;
- ``public``: everything else.

IPv4-mapped, NAT64 and 6to4 IPv6 addresses are judged by the IPv4 address they carry.

A :class:`DialGuard` subclass says which addresses its user may reach (``check``); the guard gives aiohttp a
resolver that drops the addresses a name may not use (the addresses are never looked up twice) and a socket
factory that checks the address again right before the socket connects, so an address literal, a redirect, or
any path that skips the resolver is held to the same rule.
"""

from __future__ import annotations

import ipaddress
import socket
from abc import ABC, abstractmethod
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


def address_kind(address: Address, host: Any = ()) -> Kind:
    """The kind of ``address`` (see the module docstring); ``host``: this host's own addresses."""
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


def is_loopback_address(address: Address) -> bool:
    """Whether ``address`` (or the IPv4 address it carries) is loopback."""
    return embedded_ipv4(address).is_loopback


class AddressRefused(OSError):
    """The guarded client may not connect to this address; the message says why and what to change."""


class DialGuard(ABC):
    """The rule of one kind of guarded request. ``host_addresses``: this host's own (read from the kernel by
    default)."""

    #: What a refusal raises (a subclass of AddressRefused naming the guarded kind of request).
    refusal: type[AddressRefused] = AddressRefused

    def __init__(self, host_addresses: HostAddresses | None = None) -> None:
        self.host_addresses = host_addresses or HostAddresses()

    def kind(self, address: Address) -> Kind:
        """The kind of ``address``, this host's own addresses counting as private."""
        return address_kind(address, self.host_addresses.get())

    @abstractmethod
    def check(self, host: str, port: int, address: Address) -> None:
        """Raise AddressRefused unless ``address``:``port`` may be connected to for ``host`` (the name or address
        literal the request named)."""

    def resolved(self, host: str, port: int, address: Address) -> None:
        """The resolver gave out ``address`` for ``host`` after ``check`` let it through (a guard that allows an
        address because of the name it was found under remembers it here)."""

    def resolver(self) -> AbstractResolver:
        """An aiohttp resolver that keeps only the addresses a name may be connected to."""
        return _GuardedResolver(self)

    def socket_factory(self, addr_info: tuple[Any, ...]) -> socket.socket:
        """aiohttp's ``socket_factory``: a socket for ``addr_info`` once its address passed ``check`` (the
        address as dialled; the name is not known here, so it stands as the host)."""
        family, type_, proto, _, sockaddr = addr_info
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        self.check(str(address), int(sockaddr[1]), address)
        return socket.socket(family, type_, proto)


class _GuardedResolver(AbstractResolver):
    def __init__(self, guard: DialGuard) -> None:
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
            except AddressRefused as exc:
                refusals.append(str(exc))
                continue
            self._guard.resolved(host, port, address)
            kept.append(result)
        if not kept:
            raise self._guard.refusal(refusals[0] if refusals else f"{host} has no address")
        return kept

    async def close(self) -> None:
        await self._inner.close()


def refusal_behind(exc: BaseException) -> AddressRefused | None:
    """The guard's refusal behind ``exc`` (aiohttp wraps it in a connector error), if any."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return None
        if isinstance(seen, AddressRefused):
            return seen
        inner = getattr(seen, "os_error", None)
        seen = inner if isinstance(inner, BaseException) else (seen.__cause__ or seen.__context__)
    return None
