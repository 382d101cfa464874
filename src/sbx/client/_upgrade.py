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

from sbx.api.errors import Internal, SandboxError, Unavailable
from sbx.client._endpoint import CONNECT_TIMEOUT_SECS, Endpoint, Params, error_for, translate_error

#: A raw byte stream after an HTTP Upgrade.
Upgraded = tuple[asyncio.StreamReader, asyncio.StreamWriter]

#: Largest error body read from a refused upgrade (bytes); the spec's error bodies are small.
MAX_ERROR_BODY_BYTES = 1 << 20
#: Buffer limit of the returned reader (bytes): how much the SDK holds before reading pauses,
#: and the largest answer head accepted from a server.
READ_LIMIT_BYTES = 256 * 1024


def build_request(endpoint: Endpoint, path: str, protocol: str, params: Params | None) -> bytes:
    """The bytes of the upgrade request for ``path`` (under the endpoint's base path)."""
    base = urlsplit(endpoint.base_url)
    target = base.path.rstrip("/") + path
    if params:
        target += "?" + urlencode(list(params.items()) if isinstance(params, Mapping) else list(params))
    # Over a unix socket the guard wants a loopback Host; over TCP it is the address as written.
    host = "localhost" if endpoint.socket_path is not None else base.netloc
    lines = [
        f"GET {target} HTTP/1.1",
        f"Host: {host}",
        "Connection: Upgrade",
        f"Upgrade: {protocol}",
    ]
    if endpoint.token:
        lines.append(f"Authorization: Bearer {endpoint.token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """``(status, headers)`` of an answer head (through the blank line); names are lowercased.

    Raises ``Internal`` when it is not an HTTP/1.x answer.
    """
    text = head.decode("latin-1")
    status_line, _, rest = text.partition("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise Internal(f"the server did not answer the upgrade with HTTP: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in rest.split("\r\n"):
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise Internal(f"the server sent a malformed header line: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


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
                    raise error_for(status, await read_refusal_body(reader, headers))
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


async def read_refusal_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    """The body of an answer that refused an upgrade (at most MAX_ERROR_BODY_BYTES), after its head."""
    length = headers.get("content-length", "")
    if length.isdigit():
        return await reader.readexactly(min(int(length), MAX_ERROR_BODY_BYTES))
    # No length: the body runs to the end of the connection (we never ask for keep-alive here).
    return await reader.read(MAX_ERROR_BODY_BYTES)
