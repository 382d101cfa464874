"""``AsyncClient``: one server (node or gateway), its resource namespaces and the raw calls under them.

    async with AsyncClient() as client:            # SANDBOX_URL / SANDBOX_TOKEN, else /run/sandboxd.sock
        sandbox = await client.sandboxes.create(image="python:3.12")
        ...

Every non-2xx answer raises the matching ``SandboxError`` subclass (``NotFound``, ``Conflict``,
...); failing to reach the server raises ``Unavailable``.
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Self, TypeVar

from sbx.api.codec import decode_answer
from sbx.api.errors import Internal, error_from_answer
from sbx.api.node import Capabilities, CordonRequest, NodeStatus
from sbx.client._admin import Admin
from sbx.client._endpoint import Params, resolve_endpoint
from sbx.client._images import Images
from sbx.client._sandbox import Sandboxes
from sbx.client._ssh import Ssh
from sbx.client._storage import Snapshots, Volumes
from sbx.client._transport import AiohttpTransport, Response, Transport
from sbx.client._upgrade import Upgraded
from sbx.client._workloads import Jobs, Secrets, Services

T = TypeVar("T")


class AsyncClient:
    """An async client of one server; use as ``async with AsyncClient() as client: ...``.

    ``url`` and ``token`` default to ``SANDBOX_URL`` and ``SANDBOX_TOKEN``, then to the local
    socket ``/run/sandboxd.sock``. ``timeout_secs`` bounds each plain request (default ``None``:
    no limit, as a run lasts as long as its command; streams and upgrades are never bounded once
    connected). ``transport`` replaces the network (tests).

    Namespaces: ``client.sandboxes`` (create, list, get, delete), ``client.images``, ``client.snapshots``,
    ``client.volumes`` and, on a gateway, ``client.admin``, ``client.services``, ``client.jobs``,
    ``client.secrets`` and ``client.ssh``. Answers are the wire types of ``sbx.api``.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_secs: float | None = None,
        transport: Transport | None = None,
    ) -> None:
        self._transport = transport or AiohttpTransport(resolve_endpoint(url, token), timeout_secs)
        self.sandboxes = Sandboxes(self)
        self.images = Images(self)
        self.snapshots = Snapshots(self)
        self.volumes = Volumes(self)
        self.admin = Admin(self)
        self.services = Services(self)
        self.jobs = Jobs(self)
        self.secrets = Secrets(self)
        self.ssh = Ssh(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections; the client is not used afterwards."""
        await self._transport.aclose()

    # -- server-wide calls ---------------------------------------------------------------------

    async def capabilities(self) -> Capabilities:
        """``GET /v1/capabilities``: API version, backend, capability flags, limits, network."""
        return await self.call("GET", "/v1/capabilities", Capabilities)

    async def node(self) -> NodeStatus:
        """``GET /v1/node``: the NodeStatus (a node server only; a gateway answers 404)."""
        return await self.call("GET", "/v1/node", NodeStatus)

    async def cordon(self, cordoned: bool = True) -> NodeStatus:
        """``POST /v1/node/cordon``: stop (``True``) or resume (``False``) taking new sandboxes."""
        return await self.call("POST", "/v1/node/cordon", NodeStatus, json=CordonRequest(cordoned))

    # -- raw calls (what the resource objects are made of) ---------------------------------------

    async def call(
        self, method: str, path: str, answer: type[T], *, json: Any = None, params: Params | None = None
    ) -> T:
        """Send one request whose 2xx answer is the JSON of ``answer`` (a wire type) and decode it; a non-2xx
        answer raises the matching ``SandboxError`` subclass, a malformed one ``Internal``."""
        resp = await self._transport.request(method, path, json=json, params=params)
        if not 200 <= resp.status < 300:
            raise error_from_answer(resp.status, resp.body)
        return decode_answer(resp.body, answer, f"{answer.__name__} (HTTP {resp.status} of {method} {path})")

    async def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        data: bytes | None = None,
        params: Params | None = None,
        *,
        raw: bool = False,
    ) -> Any:
        """Send one request to ``path`` (e.g. ``/v1/sandboxes``) and return the decoded answer.

        JSON answers are decoded, 204 is ``None``, anything else is the raw bytes (always the
        bytes with ``raw=True``). A non-2xx answer raises the matching ``SandboxError`` subclass.
        """
        resp = await self._transport.request(method, path, json=json, data=data, params=params)
        if not 200 <= resp.status < 300:
            raise error_from_answer(resp.status, resp.body)
        if raw:
            return resp.body
        if resp.status == 204 or not resp.body:
            return None
        if resp.content_type == "application/json":
            return _decode_json(resp)
        return resp.body

    async def stream_lines(
        self, method: str, path: str, *, json: Any = None, params: Params | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Follow an ndjson answer, one decoded object per line, as the server flushes them."""
        pending = b""
        async for chunk in self._transport.stream(method, path, json=json, params=params):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    yield _decode_line(line)
        if pending.strip():
            yield _decode_line(pending)

    async def stream_bytes(
        self, method: str, path: str, *, params: Params | None = None
    ) -> AsyncIterator[bytes]:
        """Follow a raw answer (a file's bytes), chunk by chunk as they arrive, so that a large one need not
        be held whole; a non-2xx answer raises the matching ``SandboxError`` subclass."""
        async for chunk in self._transport.stream(method, path, params=params):
            yield chunk

    async def upgrade(self, path: str, protocol: str, *, params: Params | None = None) -> Upgraded:
        """Switch a ``GET path`` connection to ``protocol``; the raw reader and writer."""
        return await self._transport.upgrade(path, protocol, params=params)


def _decode_json(resp: Response) -> Any:
    try:
        return jsonlib.loads(resp.body)
    except ValueError as exc:
        raise Internal(f"the server sent invalid JSON (HTTP {resp.status}): {exc}") from exc


def _decode_line(line: bytes) -> dict[str, Any]:
    try:
        value = jsonlib.loads(line)
    except ValueError as exc:
        raise Internal(f"the server sent an invalid ndjson line: {exc}") from exc
    if not isinstance(value, dict):
        raise Internal(f"the server sent an ndjson line that is not an object: {line[:80]!r}")
    return value
