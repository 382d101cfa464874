"""Which addresses the image puller may connect to (docs/images.md, "Registries on private addresses").

An image reference names a host, and whoever may create a sandbox chooses the reference: without a check,
``127.0.0.1:8080/x`` or ``169.254.169.254/x`` would make sandboxd send requests to services of this host or
its cloud that nobody else can reach. The kinds of addresses are those of :mod:`sbx.net.dial_guard`:

- ``forbidden`` ones (link-local, metadata, unspecified, reserved) are never connected to;
- ``private`` ones (loopback, this host's own, RFC 1918, ...) only for a registry the operator listed in
  ``[images] allow_private_registries``;
- ``public`` ones always.

The check happens when connecting, on the address connected to (``DialGuard``'s resolver and socket factory):
a name resolving to loopback is refused, the addresses are never looked up twice, and an address literal in a
reference, or a redirect to one, is checked before the socket connects. Every connection of the puller goes
through both: registry, token server, and every redirect.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from sbx.net.dial_guard import AddressRefused, DialGuard, Kind, address_kind, embedded_ipv4
from sbx.net.ranges import Address, HostAddresses

__all__ = [
    "DEFAULT_PORTS",
    "Kind",
    "RegistryAddressRefused",
    "RegistryAddresses",
    "address_kind",
    "embedded_ipv4",
    "split_host_port",
]

#: Ports a listed registry without one may be reached on (HTTPS, and HTTP for an insecure registry).
DEFAULT_PORTS: Final = (443, 80)


class RegistryAddressRefused(AddressRefused):
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


class RegistryAddresses(DialGuard):
    """The puller's connection guard. ``allow_private`` lists ``host[:port]`` entries that may be on private
    addresses (a name, or an address literal; without a port, ports 443 and 80). ``host_addresses`` are this
    host's own addresses (read from the kernel by default)."""

    refusal = RegistryAddressRefused

    def __init__(
        self, allow_private: Iterable[str] = (), host_addresses: HostAddresses | None = None
    ) -> None:
        super().__init__(host_addresses)
        self._allowed: set[tuple[str, int]] = set()
        for entry in allow_private:
            host, port = split_host_port(entry)
            self._allowed.update((host, p) for p in ((port,) if port is not None else DEFAULT_PORTS))
        #: Private (address, port) pairs the resolver gave out for a listed name: the socket factory lets
        #: them through.
        self._resolved: set[tuple[Address, int]] = set()

    def allows_private(self, host: str, port: int) -> bool:
        """Whether ``host`` (a name or an address, as a URL spells it) on ``port`` is listed."""
        return (split_host_port(host)[0], port) in self._allowed

    def check(self, host: str, port: int, address: Address) -> None:
        """Raise RegistryAddressRefused unless the puller may connect to ``address``:``port`` for ``host``."""
        kind = self.kind(address)
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

    def resolved(self, host: str, port: int, address: Address) -> None:
        if self.kind(address) != "private":
            return
        if len(self._resolved) >= 4096:
            self._resolved.clear()  # names of listed registries only: a handful; never grows past this
        self._resolved.add((address, port))


def _entry(host: str, port: int) -> str:
    host = f"[{host}]" if ":" in host else host
    return host if port == 443 else f"{host}:{port}"
