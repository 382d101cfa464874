"""HTTP/1.1 Upgrade to a raw byte stream, done by hand over an asyncio connection.

aiohttp's client only upgrades to WebSocket, so attach (``sbx-stream/1``) and tunnel
(``sbx-tunnel/1``) open their own connection (unix socket, TCP, or TCP with TLS for https), send
one ``GET`` with ``Connection: Upgrade``, read the answer's head, and on ``101 Switching
Protocols`` hand back the reader and writer, positioned at the first byte after the head. Any
other answer is read whole and raised as the matching ``SandboxError``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from urllib.parse import urlencode, urlsplit

from sbx.api.errors import Internal, SandboxError, Unavailable, error_from_answer
from sbx.client._endpoint import CONNECT_TIMEOUT_SECS, Endpoint, Params, translate_error
from sbx.web.upgrade import READ_LIMIT_BYTES, parse_head, read_refusal_body, request_head

#: A raw byte stream after an HTTP Upgrade.
Upgraded = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def build_request(endpoint: Endpoint, path: str, protocol: str, params: Params | None) -> bytes:
    """The bytes of the upgrade request for ``path`` (under the endpoint's base path)."""
    base = urlsplit(endpoint.base_url)
    target = base.path.rstrip("/") + path
    if params:
        target += "?" + urlencode(list(params.items()) if isinstance(params, Mapping) else list(params))
    # Over a unix socket the guard wants a loopback Host; over TCP it is the address as written.
    host = "localhost" if endpoint.socket_path is not None else base.netloc
    headers = {"Authorization": f"Bearer {endpoint.token}"} if endpoint.token else {}
    return request_head(target, host, protocol, headers)


async def open_upgraded(
    endpoint: Endpoint,
    path: str,
    protocol: str,
    params: Params | None = None,
    *,
    connect_timeout_secs: float = CONNECT_TIMEOUT_SECS,
) -> Upgraded:
    """Connect, ask to switch ``path`` to ``protocol`` and return the raw stream.

    Connecting and the server's answer are bounded by ``connect_timeout_secs`` (default 10 s);
    the stream itself has no time limit. A refused upgrade raises the answer's ``SandboxError``;
    failing to connect raises ``Unavailable``.
    """
    try:
        async with asyncio.timeout(connect_timeout_secs):
            reader, writer = await _connect(endpoint)
            try:
                writer.write(build_request(endpoint, path, protocol, params))
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                status, headers = parse_head(head)
                if status != 101:
                    raise error_from_answer(status, await read_refusal_body(reader, headers))
                if headers.get("upgrade", "").lower() != protocol.lower():
                    raise Internal(
                        f"the server switched to {headers.get('upgrade')!r} instead of {protocol!r}"
                    )
            except BaseException:
                writer.close()
                raise
    except SandboxError:
        raise
    except asyncio.LimitOverrunError as exc:
        raise Internal(f"the server's answer head is over {READ_LIMIT_BYTES} bytes") from exc
    except asyncio.IncompleteReadError as exc:
        raise Unavailable(
            f"sandboxd at {endpoint.display} closed the connection before answering the upgrade"
        ) from exc
    except (TimeoutError, OSError) as exc:
        raise translate_error(exc, endpoint) from exc
    return reader, writer


async def _connect(endpoint: Endpoint) -> Upgraded:
    if endpoint.socket_path is not None:
        return await asyncio.open_unix_connection(endpoint.socket_path, limit=READ_LIMIT_BYTES)
    base = urlsplit(endpoint.base_url)
    tls = base.scheme == "https"
    host = base.hostname or "localhost"
    port = base.port or (443 if tls else 80)
    context = ssl.create_default_context() if tls else None
    return await asyncio.open_connection(host, port, ssl=context, limit=READ_LIMIT_BYTES)
