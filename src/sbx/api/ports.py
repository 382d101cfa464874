"""Wire types of exposed ports (an addition, capability ``exposed_ports``; docs/ports.md): a sandbox's TCP ports
on a URL of their own under the gateway's ``--ports-domain``, private by default, and the node's listing of what
its guest listens on (capability ``listening_ports``) that the gateway builds them from."""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

#: Capability flag of a gateway started with ``--ports-domain``.
EXPOSED_PORTS = "exposed_ports"
#: Capability flag of a node that answers ``GET /v1/sandboxes/{ref}/listening``.
LISTENING_PORTS = "listening_ports"
#: A port token's lifetime when the request names none, and its bounds, in seconds.
DEFAULT_TOKEN_TTL_SECS = 3600
MAX_TOKEN_TTL_SECS = 86400


class Port(msgspec.Struct, kw_only=True):
    """One TCP port of a sandbox: ``url`` where a browser opens it (scheme as the caller reached the gateway),
    ``public`` (anyone may open it; else the owner's key or a port token), ``listening`` (the guest listens on it
    now, on any address)."""

    port: int
    url: str
    public: bool
    listening: bool


class PortList(msgspec.Struct):
    """``GET /v1/sandboxes/{ref}/ports``: every port the guest listens on and every public one, by number."""

    ports: list[Port]


class PortRequest(msgspec.Struct, kw_only=True):
    """``PUT /v1/sandboxes/{ref}/ports/{port}``: make the port public or private again."""

    public: bool


class PortTokenRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/sandboxes/{ref}/ports/{port}/tokens``: ``ttl_secs`` 1 to 86400 (default 3600)."""

    ttl_secs: int | UnsetType = UNSET


class PortToken(msgspec.Struct, kw_only=True):
    """A port token: ``url`` carries it (opening it trades it for a cookie of that one host); it opens that port
    of that sandbox only, until ``expires_at`` (RFC 3339), or until its key is revoked or the sandbox ends."""

    token: str
    url: str
    expires_at: str


class ListeningPorts(msgspec.Struct, kw_only=True):
    """``GET /v1/sandboxes/{ref}/listening`` on a node: the TCP ports the guest listens on (any address, IPv4 or
    IPv6), ascending. ``awake`` false: the sandbox is not running (suspended, stopped, pending), so nothing is
    listed and it was not woken to look."""

    ports: list[int]
    awake: bool
