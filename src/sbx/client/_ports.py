"""``sandbox.ports``: a sandbox's TCP ports on URLs of their own (capability ``exposed_ports``: a gateway run with
``--ports-domain``; docs/ports.md). A gateway without it, and a plain node, answer these 501 ``unsupported``.

    for port in await sandbox.ports.list():            # Port(port, url, public, listening)
        print(port.port, port.url, port.public, port.listening)
    link = await sandbox.ports.token(8000, ttl_secs=600)  # a URL a browser opens without a key
    await sandbox.ports.public(8000, True)              # anyone may open it now
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgspec import UNSET

from sbx.api.errors import InvalidRequest
from sbx.api.ports import MAX_TOKEN_TTL_SECS, Port, PortList, PortRequest, PortToken, PortTokenRequest

if TYPE_CHECKING:
    from sbx.client._client import AsyncClient


def check_port(port: int) -> int:
    """``port`` if it is a TCP port number (1 to 65535), else ``InvalidRequest`` before anything is sent."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidRequest(f"port {port!r}: give a TCP port number, 1 to 65535")
    return port


def check_ttl(ttl_secs: int | None) -> int | None:
    """``ttl_secs`` if it is ``None`` (the server's default, 3600) or 1 to 86400, else ``InvalidRequest``."""
    if ttl_secs is None:
        return None
    if isinstance(ttl_secs, bool) or not isinstance(ttl_secs, int) or not 1 <= ttl_secs <= MAX_TOKEN_TTL_SECS:
        raise InvalidRequest(f"ttl_secs {ttl_secs!r}: give 1 to {MAX_TOKEN_TTL_SECS} seconds (default 3600)")
    return ttl_secs


class Ports:
    """The ports of one sandbox. A private port (the default) opens with the owner's key as a Bearer token or
    with a port token (``token()``); a public one opens for anyone who has its URL."""

    def __init__(self, client: AsyncClient, sandbox_path: str) -> None:
        self._client = client
        self._path = sandbox_path + "/ports"

    async def list(self) -> list[Port]:
        """``GET .../ports``: every port the guest listens on and every public one, by number."""
        return (await self._client.call("GET", self._path, PortList)).ports

    async def get(self, port: int) -> Port:
        """``GET .../ports/{port}``: one port (any 1 to 65535, listened on or not)."""
        return await self._client.call("GET", f"{self._path}/{check_port(port)}", Port)

    async def url(self, port: int) -> str:
        """The URL of ``port`` (``http(s)://<label>.<ports domain>/``): it opens with the owner's key, or for
        anyone once the port is public; for a browser without a key use ``token()``."""
        return (await self.get(port)).url

    async def public(self, port: int, public: bool = True) -> Port:
        """``PUT .../ports/{port}``: make ``port`` public (``True``: anyone with the URL may open it) or private
        again (``False``); returns the Port. Needs the scope ``sandbox:create``."""
        if not isinstance(public, bool):
            raise InvalidRequest(f"public {public!r}: give True (anyone may open it) or False (private)")
        body = PortRequest(public=public)
        return await self._client.call("PUT", f"{self._path}/{check_port(port)}", Port, json=body)

    async def token(self, port: int, ttl_secs: int | None = None) -> PortToken:
        """``POST .../ports/{port}/tokens``: a port token good for ``ttl_secs`` (1 to 86400, default 3600).
        Its ``url`` opens that one port in a browser without a key (the token becomes a cookie of that host);
        it ends at ``expires_at``, or earlier when the key that made it is revoked or the sandbox ends."""
        ttl = check_ttl(ttl_secs)
        body = PortTokenRequest(ttl_secs=UNSET if ttl is None else ttl)
        return await self._client.call(
            "POST", f"{self._path}/{check_port(port)}/tokens", PortToken, json=body
        )
