"""A typed client of one node (a ``sandboxd``): what the gateway asks a node, in the wire contract's types, and
the raw primitives the relay passes client requests through.

Endpoints: ``https://host:port`` (optionally a CA file, a client certificate and key), ``unix:///path``, or
``http://host:port`` on loopback only. A token file's contents are sent as the bearer token.

Every failure is the project's own error: a node's error answer is its ``SandboxError`` (re-raised as sent);
no answer at all (cannot connect, cut off, timed out, malformed) is ``BadGateway`` (502) naming the node.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import quote, urlencode, urlsplit

import aiohttp
import msgspec

from sbx.api import frames
from sbx.api.codec import decode_answer, encode
from sbx.api.errors import BadGateway, InvalidRequest, SandboxError, error_from_answer
from sbx.api.node import CordonRequest, NodeStatus
from sbx.api.ports import ListeningPorts
from sbx.api.processes import (
    OutputChunk,
    OutputExit,
    Process,
    ProcessList,
    ProcessRequest,
    RunRequest,
    RunResult,
    SignalRequest,
)
from sbx.api.sandboxes import CreateRequest, Sandbox, SandboxList
from sbx.api.snapshots import Snapshot, SnapshotList
from sbx.api.volumes import Volume, VolumeCreateRequest, VolumeList
from sbx.gateway.state import NodeDef
from sbx.net.loopback import is_loopback
from sbx.web.upgrade import READ_LIMIT_BYTES, parse_head, read_refusal_body, request_head

T = TypeVar("T")

#: Seconds to connect to a node before the call counts as the node not answering.
CONNECT_TIMEOUT_SECS = 5.0
#: Seconds a typed call waits for the node's whole answer.
CALL_TIMEOUT_SECS = 30.0
#: Relayed calls wait for the node as long as it takes (a run, a followed stream); connecting is bounded.
RELAY_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_SECS)

#: A raw byte stream after an HTTP Upgrade.
Upgraded = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass(frozen=True)
class Refusal:
    """A node's answer to an upgrade that is not 101: passed on to the client as sent."""

    status: int
    content_type: str | None
    body: bytes

    def reason(self) -> str:
        """``HTTP <status>: <the node's error message>``, for errors that name why a tunnel was refused;
        ``HTTP <status>`` alone when the body is not the error JSON (a proxy's page, nothing)."""
        status = f"HTTP {self.status}"
        message = error_from_answer(self.status, self.body).message
        return status if message == status else f"{status}: {message}"


@dataclass(frozen=True)
class Target:
    """Where a node listens: ``socket_path`` for unix, else ``host``/``port`` and TLS for https."""

    base_url: str
    socket_path: str | None
    host: str
    port: int
    tls: bool


def parse_endpoint(endpoint: str) -> Target:
    """Check and split a node endpoint; raises ``InvalidRequest`` naming the accepted forms."""
    forms = "use https://HOST:PORT, unix:///PATH, or http://HOST:PORT on loopback"
    if endpoint.startswith("unix://"):
        path = endpoint[len("unix://") :]
        if not path.startswith("/"):
            raise InvalidRequest(f"node endpoint {endpoint!r} needs an absolute socket path: unix:///PATH")
        return Target("http://localhost", path, "localhost", 0, False)
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(f"node endpoint {endpoint!r} is not accepted: {forms}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidRequest(f"node endpoint {endpoint!r} takes no path or query: {forms}")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise InvalidRequest(
            f"node endpoint {endpoint!r}: plain http is allowed on loopback only (the token would travel in "
            "clear); use https"
        )
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise InvalidRequest(f"node endpoint {endpoint!r} has a bad port: {forms}") from None
    return Target(f"{parts.scheme}://{parts.netloc}", None, parts.hostname, port, parts.scheme == "https")


def describe(exc: BaseException) -> str:
    """A short, secret-free description of a connection failure."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    return type(exc).__name__ + (f": {exc}" if str(exc) else "")


class NodeClient:
    """Talks to one node over its own kept-alive connections."""

    def __init__(
        self, name: str, target: Target, token: str | None, ssl_context: ssl.SSLContext | None
    ) -> None:
        self.name = name
        self.target = target
        self.ssl_context = ssl_context
        #: The headers every call carries (the token), shared and built once: aiohttp copies what it is given.
        self.auth_headers: dict[str, str] = {"Authorization": f"Bearer {token}"} if token else {}
        connector: aiohttp.BaseConnector
        if target.socket_path is not None:
            connector = aiohttp.UnixConnector(path=target.socket_path, limit=0)
        else:
            connector = aiohttp.TCPConnector(ssl=ssl_context if ssl_context is not None else False, limit=0)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)

    def url(self, path_qs: str) -> str:
        return self.target.base_url + path_qs

    async def close(self) -> None:
        await self.session.close()

    # -- typed calls -------------------------------------------------------------------------------

    async def call(
        self,
        method: str,
        path: str,
        answer: type[T] | None,
        body: object = None,
        timeout_secs: float = CALL_TIMEOUT_SECS,
    ) -> T | None:
        """One call whose 2xx answer is ``answer`` (None: no body expected); a node's error answer raises its
        ``SandboxError``, no (or a malformed) answer ``BadGateway``."""
        headers = dict(self.auth_headers)
        data = None
        if body is not None:
            data = encode(body)
            headers["Content-Type"] = "application/json"
        try:
            async with self.session.request(
                method, self.url(path), data=data, headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_secs, connect=CONNECT_TIMEOUT_SECS),
            ) as resp:  # fmt: skip
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise BadGateway(f"node {self.name} did not answer: {describe(exc)}") from exc
        if status >= 300:
            raise error_from_answer(status, raw)
        if answer is None:
            return None
        try:
            return decode_answer(raw, answer, answer.__name__)
        except SandboxError as exc:
            raise BadGateway(f"node {self.name}: {exc.message}") from None

    async def _expect(
        self,
        method: str,
        path: str,
        answer: type[T],
        body: object = None,
        timeout_secs: float = CALL_TIMEOUT_SECS,
    ) -> T:
        found = await self.call(method, path, answer, body, timeout_secs)
        assert found is not None
        return found

    async def status(self, timeout_secs: float = CALL_TIMEOUT_SECS) -> NodeStatus:
        """``GET /v1/node``."""
        return await self._expect("GET", "/v1/node", NodeStatus, timeout_secs=timeout_secs)

    async def cordon(self, cordoned: bool, timeout_secs: float = CALL_TIMEOUT_SECS) -> NodeStatus:
        """``POST /v1/node/cordon``."""
        return await self._expect(
            "POST", "/v1/node/cordon", NodeStatus, CordonRequest(cordoned), timeout_secs=timeout_secs
        )

    async def sandboxes(self, labels: Iterable[tuple[str, str]] = ()) -> list[Sandbox]:
        """``GET /v1/sandboxes`` (with ``label=key=value`` filters), newest first."""
        query = urlencode([("label", f"{k}={v}") for k, v in labels])
        path = "/v1/sandboxes" + (f"?{query}" if query else "")
        return (await self._expect("GET", path, SandboxList)).sandboxes

    async def create_sandbox(self, request: CreateRequest) -> Sandbox:
        """``POST /v1/sandboxes``."""
        return await self._expect("POST", "/v1/sandboxes", Sandbox, request)

    async def delete_sandbox(self, sandbox_id: str) -> None:
        """``DELETE /v1/sandboxes/{id}`` (idempotent)."""
        await self.call("DELETE", f"/v1/sandboxes/{sandbox_id}", None)

    async def snapshots(self) -> list[Snapshot]:
        """``GET /v1/snapshots``."""
        return (await self._expect("GET", "/v1/snapshots", SnapshotList)).snapshots

    async def volumes(self) -> list[Volume]:
        """``GET /v1/volumes``."""
        return (await self._expect("GET", "/v1/volumes", VolumeList)).volumes

    async def create_volume(self, request: VolumeCreateRequest) -> Volume:
        """``POST /v1/volumes``."""
        return await self._expect("POST", "/v1/volumes", Volume, request)

    # -- processes, files and tunnels of one sandbox (what services, jobs and SSH sessions use) --------

    async def sandbox(self, sandbox_id: str) -> Sandbox:
        """``GET /v1/sandboxes/{id}``."""
        return await self._expect("GET", f"/v1/sandboxes/{sandbox_id}", Sandbox)

    async def listening(self, sandbox_id: str) -> ListeningPorts:
        """``GET /v1/sandboxes/{id}/listening`` (capability ``listening_ports``): the TCP ports its guest listens
        on; a sleeping sandbox is not woken (``awake`` false, no ports)."""
        return await self._expect("GET", f"/v1/sandboxes/{sandbox_id}/listening", ListeningPorts)

    async def run(
        self, sandbox_id: str, request: RunRequest, timeout_secs: float = CALL_TIMEOUT_SECS
    ) -> RunResult:
        """``POST /v1/sandboxes/{id}/run``: a command to completion, waiting at most ``timeout_secs`` for the
        node's answer."""
        return await self._expect("POST", f"/v1/sandboxes/{sandbox_id}/run", RunResult, request, timeout_secs)

    async def start_process(self, sandbox_id: str, request: ProcessRequest) -> Process:
        """``POST /v1/sandboxes/{id}/processes``: a background process (on a terminal with ``tty``)."""
        return await self._expect("POST", f"/v1/sandboxes/{sandbox_id}/processes", Process, request)

    async def processes(self, sandbox_id: str) -> list[Process]:
        """``GET /v1/sandboxes/{id}/processes``."""
        return (await self._expect("GET", f"/v1/sandboxes/{sandbox_id}/processes", ProcessList)).processes

    async def process(self, sandbox_id: str, pid: int) -> Process:
        """``GET /v1/sandboxes/{id}/processes/{pid}``."""
        return await self._expect("GET", f"/v1/sandboxes/{sandbox_id}/processes/{pid}", Process)

    async def signal(
        self, sandbox_id: str, pid: int, name: str, timeout_secs: float = CALL_TIMEOUT_SECS
    ) -> None:
        """``POST /v1/sandboxes/{id}/processes/{pid}/signal``: INT, TERM, KILL or HUP."""
        path = f"/v1/sandboxes/{sandbox_id}/processes/{pid}/signal"
        await self.call("POST", path, None, SignalRequest(name), timeout_secs)

    async def follow_output(self, sandbox_id: str, pid: int) -> AsyncIterator[OutputChunk | OutputExit]:
        """``GET .../processes/{pid}/output``: the output from the start, chunk by chunk, ending with the exit.

        A node's error answer raises its ``SandboxError``; a stream cut before the exit raises ``BadGateway``."""
        url = self.url(f"/v1/sandboxes/{sandbox_id}/processes/{pid}/output")
        try:
            async with self.session.get(url, headers=self.auth_headers, timeout=RELAY_TIMEOUT) as resp:
                if resp.status >= 300:
                    raise error_from_answer(resp.status, await resp.read())
                async for raw in resp.content:
                    line = raw.strip()
                    if not line:
                        continue
                    try:
                        event = _OUTPUT_LINE.decode(line)
                    except msgspec.DecodeError as exc:
                        raise BadGateway(f"node {self.name} sent a malformed output line: {exc}") from None
                    if isinstance(event.exit_code, int):
                        yield OutputExit(event.exit_code, event.truncated)
                        return
                    if event.stream is not None and event.data is not None:
                        yield OutputChunk(event.stream, event.data)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise BadGateway(f"node {self.name} did not finish the output stream: {describe(exc)}") from exc
        raise BadGateway(f"node {self.name} ended the output stream of process {pid} before its exit")

    async def attach(self, sandbox_id: str, pid: int) -> Upgraded:
        """``GET .../processes/{pid}/attach`` switched to ``sbx-stream/1``; a refusal raises its error."""
        return _opened(await self.open_upgrade(f"/v1/sandboxes/{sandbox_id}/processes/{pid}/attach",
                                               frames.PROTOCOL))  # fmt: skip

    async def open_tunnel(self, sandbox_id: str, port: int) -> Upgraded | Refusal:
        """``GET /v1/sandboxes/{id}/tunnel?port=N`` switched to ``sbx-tunnel/1``: a TCP stream to the guest's
        127.0.0.1:N on 101, else the node's answer."""
        return await self.open_upgrade(f"/v1/sandboxes/{sandbox_id}/tunnel?port={port}", "sbx-tunnel/1")

    async def tunnel(self, sandbox_id: str, port: int) -> Upgraded:
        """:meth:`open_tunnel`, a refusal raised as its error."""
        return _opened(await self.open_tunnel(sandbox_id, port))

    async def read_file(self, sandbox_id: str, path: str) -> aiohttp.ClientResponse:
        """``GET /v1/sandboxes/{id}/files?path=``: the answer, its body not yet read (``content`` streams it;
        release it when done). A node's refusal raises its error."""
        try:
            resp = await self.session.get(
                self.url(_file_path(sandbox_id, "files", path)),
                headers=self.auth_headers,
                timeout=RELAY_TIMEOUT,
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise BadGateway(f"node {self.name} did not answer: {describe(exc)}") from exc
        if resp.status >= 300:
            try:
                raise error_from_answer(resp.status, await resp.read())
            finally:
                resp.release()
        return resp

    async def read_small_file(self, sandbox_id: str, path: str, max_bytes: int) -> bytes | None:
        """The contents of a file, or None when longer than ``max_bytes`` (read no further). A node's 404
        (absent) is raised as ``NotFound``."""
        resp = await self.read_file(sandbox_id, path)
        try:
            if resp.content_length is not None and resp.content_length > max_bytes:
                return None
            data = bytearray()
            async for chunk in resp.content.iter_any():
                data += chunk
                if len(data) > max_bytes:
                    return None
            return bytes(data)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise BadGateway(f"node {self.name} did not answer: {describe(exc)}") from exc
        finally:
            resp.release()

    async def write_file(self, sandbox_id: str, path: str, data: bytes | AsyncIterable[bytes]) -> None:
        """``PUT /v1/sandboxes/{id}/files?path=`` of ``data``, or of the body streamed from it (at most 64 MiB);
        parents are made."""
        headers = {**self.auth_headers, "Content-Type": "application/octet-stream"}
        try:
            async with self.session.put(
                self.url(_file_path(sandbox_id, "files", path)), data=data, headers=headers, timeout=RELAY_TIMEOUT
            ) as resp:  # fmt: skip
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise BadGateway(f"node {self.name} did not answer: {describe(exc)}") from exc
        if status >= 300:
            raise error_from_answer(status, raw)

    # -- the relay's primitives --------------------------------------------------------------------

    def request(
        self, method: str, path_qs: str, data: Any, content_type: str | None
    ) -> aiohttp.client._RequestContextManager:
        """A raw request, answered as the node answers (the relay passes it on as sent)."""
        headers = (
            self.auth_headers if not content_type else {**self.auth_headers, "Content-Type": content_type}
        )
        return self.session.request(
            method, self.url(path_qs), data=data, headers=headers, timeout=RELAY_TIMEOUT
        )

    async def open_upgrade(self, path_qs: str, protocol: str) -> Upgraded | Refusal:
        """Ask the node to switch ``path_qs`` to ``protocol``: the raw stream on 101, else its answer."""
        target = self.target
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_SECS * 2):
                if target.socket_path is not None:
                    reader, writer = await asyncio.open_unix_connection(
                        target.socket_path, limit=READ_LIMIT_BYTES
                    )
                else:
                    reader, writer = await asyncio.open_connection(
                        target.host, target.port, ssl=self.ssl_context, limit=READ_LIMIT_BYTES
                    )
                try:
                    host = "localhost" if target.socket_path is not None else f"{target.host}:{target.port}"
                    writer.write(request_head(path_qs, host, protocol, self.auth_headers))
                    await writer.drain()
                    status, headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
                    if status == 101:
                        return reader, writer
                    body = await read_refusal_body(reader, headers)
                    writer.close()
                    return Refusal(status, headers.get("content-type"), body)
                except BaseException:
                    writer.close()
                    raise
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise BadGateway(f"node {self.name} did not answer the upgrade: {describe(exc)}") from exc


class _OutputLine(msgspec.Struct):
    """One line of an output stream: a chunk ``{stream, data}`` or the exit ``{exit_code, truncated?}``."""

    stream: Literal["stdout", "stderr"] | None = None
    data: bytes | None = None
    exit_code: int | None = None
    truncated: bool | msgspec.UnsetType = msgspec.UNSET


_OUTPUT_LINE = msgspec.json.Decoder(_OutputLine)


def _file_path(sandbox_id: str, what: str, path: str) -> str:
    return f"/v1/sandboxes/{sandbox_id}/{what}?path={quote(path, safe='/')}"


def _opened(answer: Upgraded | Refusal) -> Upgraded:
    """The stream of an upgrade, or the node's refusal raised as its error."""
    if isinstance(answer, Refusal):
        raise error_from_answer(answer.status, answer.body)
    return answer


def read_token_file(path: str | None) -> str | None:
    if path is None:
        return None
    token = Path(path).read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def make_ssl_context(definition: NodeDef) -> ssl.SSLContext | None:
    if not definition.endpoint.startswith("https://"):
        return None
    context = ssl.create_default_context(cafile=definition.ca_file)
    if definition.cert_file:
        context.load_cert_chain(definition.cert_file, definition.key_file)
    return context


def connect(definition: NodeDef) -> NodeClient:
    """A client of the node ``definition`` names; raises ``InvalidRequest`` or ``OSError``/``ValueError`` for a
    bad endpoint or unreadable files."""
    target = parse_endpoint(definition.endpoint)
    token = read_token_file(definition.token_file)
    return NodeClient(definition.name, target, token, make_ssl_context(definition))
