"""How the SDK sends requests: the ``Transport`` interface and its aiohttp implementation.

Every aiohttp or OS error passes through ``translate_error`` (``_endpoint``) and leaves as a
``SandboxError``; tests replace the transport with one that calls a handler.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from sbx.api.codec import encode
from sbx.api.errors import error_from_answer
from sbx.client._endpoint import (
    CONNECT_TIMEOUT_SECS,
    DEFAULT_SOCKET,
    Endpoint,
    Params,
    resolve_endpoint,
    translate_error,
)
from sbx.client._upgrade import Upgraded, open_upgraded

__all__ = [
    "DEFAULT_SOCKET",
    "AiohttpTransport",
    "Endpoint",
    "Params",
    "Response",
    "Transport",
    "Upgraded",
    "resolve_endpoint",
]


@dataclass(frozen=True)
class Response:
    """A server answer: status, content type (without parameters) and the raw body."""

    status: int
    content_type: str
    body: bytes


class Transport(Protocol):
    """Talks to one server; raises only ``SandboxError`` (the project's, never the HTTP library's).

    ``request`` returns any answer, 2xx or not (the client maps statuses to errors); ``stream``
    yields a 2xx answer's body as it arrives and raises the error of any other; ``upgrade``
    switches the connection to ``protocol`` and returns the raw stream.
    """

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        data: bytes | None = None,
        params: Params | None = None,
    ) -> Response: ...

    def stream(
        self, method: str, path: str, *, json: Any = None, params: Params | None = None
    ) -> AsyncIterator[bytes]: ...

    async def upgrade(self, path: str, protocol: str, *, params: Params | None = None) -> Upgraded: ...

    async def aclose(self) -> None: ...


class AiohttpTransport:
    """The real transport: an aiohttp session over a unix socket or TCP (with TLS for https).

    ``timeout_secs`` bounds a whole request (``None``: no limit, since a run lasts as long as its
    command); connecting is always bounded by ``CONNECT_TIMEOUT_SECS``.
    """

    def __init__(self, endpoint: Endpoint, timeout_secs: float | None = None) -> None:
        self.endpoint = endpoint
        self._timeout = aiohttp.ClientTimeout(total=timeout_secs, sock_connect=CONNECT_TIMEOUT_SECS)
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        # Created on first use so that the session belongs to the loop that uses it.
        if self._session is None:
            connector: aiohttp.BaseConnector | None = None
            if self.endpoint.socket_path is not None:
                connector = aiohttp.UnixConnector(path=self.endpoint.socket_path)
            headers = {"Accept": "application/json"}
            if self.endpoint.token:
                headers["Authorization"] = f"Bearer {self.endpoint.token}"
            self._session = aiohttp.ClientSession(connector=connector, headers=headers, timeout=self._timeout)
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        data: bytes | None = None,
        params: Params | None = None,
    ) -> Response:
        url = self.endpoint.base_url + path
        headers = {"Content-Type": "application/octet-stream"} if data is not None else None
        if json is not None:
            # The one codec: wire Structs and plain values alike.
            data, headers = encode(json), {"Content-Type": "application/json"}
        try:
            async with self._get_session().request(
                method, url, data=data, params=params, headers=headers
            ) as resp:
                body = await resp.read()
                return Response(status=resp.status, content_type=resp.content_type, body=body)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise translate_error(exc, self.endpoint) from exc

    async def stream(
        self, method: str, path: str, *, json: Any = None, params: Params | None = None
    ) -> AsyncIterator[bytes]:
        url = self.endpoint.base_url + path
        # A stream lasts as long as what it follows (a process's output): only connecting is bounded.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_SECS)
        body, headers = (
            (encode(json), {"Content-Type": "application/json"}) if json is not None else (None, None)
        )
        try:
            async with self._get_session().request(
                method, url, data=body, params=params, timeout=timeout, headers=headers
            ) as resp:
                if not 200 <= resp.status < 300:
                    raise error_from_answer(resp.status, await resp.read())
                async for chunk in resp.content.iter_any():
                    yield chunk
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise translate_error(exc, self.endpoint) from exc

    async def upgrade(self, path: str, protocol: str, *, params: Params | None = None) -> Upgraded:
        return await open_upgraded(self.endpoint, path, protocol, params)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
