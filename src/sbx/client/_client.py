"""``AsyncClient``: the SDK's calls to a sandbox server (node or gateway), one method per endpoint.

Every non-2xx answer raises the matching ``SandboxError`` subclass (``NotFound``, ``Conflict``,
...); failing to reach the server raises ``Unavailable``. Answers are returned as the decoded
JSON the spec describes; typed models come with the full SDK.
"""

from __future__ import annotations

import base64
import binascii
import json as jsonlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

from sbx.api.errors import Internal, error_from_wire
from sbx.client._transport import AiohttpTransport, Params, Response, Transport, resolve_endpoint


@dataclass(frozen=True)
class RunResult:
    """The outcome of ``run``: output bytes (decoded from the wire's base64) and how it ended.

    ``exit_code`` is -1 when ``timed_out``; ``truncated`` says an output stream passed 8 MiB.
    """

    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> RunResult:
        """Build from the spec's run result ``{exit_code, stdout, stderr, truncated, timed_out}``."""
        try:
            return cls(
                exit_code=int(body["exit_code"]),
                stdout=base64.b64decode(body.get("stdout") or "", validate=True),
                stderr=base64.b64decode(body.get("stderr") or "", validate=True),
                truncated=bool(body.get("truncated", False)),
                timed_out=bool(body.get("timed_out", False)),
            )
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise Internal(f"the server sent a malformed run result: {exc}") from exc


class AsyncClient:
    """An async client of one server; use as ``async with AsyncClient() as client: ...``.

    ``url`` and ``token`` default to ``SANDBOX_URL`` and ``SANDBOX_TOKEN``, then to the local
    socket ``/run/sandboxd.sock``. ``timeout_secs`` bounds each request (default ``None``: no
    limit, as a run lasts as long as its command). ``transport`` replaces the network (tests).
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

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections; the client is not used afterwards."""
        await self._transport.aclose()

    async def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        data: bytes | None = None,
        params: Params | None = None,
    ) -> Any:
        """Send one request to ``path`` (e.g. ``/v1/sandboxes``) and return the decoded answer.

        JSON answers are decoded, 204 is ``None``, anything else is the raw bytes. A non-2xx
        answer raises the matching ``SandboxError`` subclass.
        """
        resp = await self._transport.request(method, path, json=json, data=data, params=params)
        if not 200 <= resp.status < 300:
            raise error_from_wire(resp.status, _decode_json(resp, strict=False))
        if resp.status == 204 or not resp.body:
            return None
        if resp.content_type == "application/json":
            return _decode_json(resp, strict=True)
        return resp.body

    # -- convenience calls, one per endpoint ---------------------------------------------------

    async def capabilities(self) -> dict[str, Any]:
        """``GET /v1/capabilities``: API version, backend, capability flags, limits, network."""
        return _dict(await self.request("GET", "/v1/capabilities"))

    async def create(self, **fields: Any) -> dict[str, Any]:
        """``POST /v1/sandboxes`` with the create request's fields (all optional); the Sandbox."""
        return _dict(await self.request("POST", "/v1/sandboxes", json=fields))

    async def list(self, labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """``GET /v1/sandboxes``, newest first; only those carrying every label in ``labels``."""
        params = [("label", f"{key}={value}") for key, value in (labels or {}).items()]
        body = _dict(await self.request("GET", "/v1/sandboxes", params=params))
        sandboxes = body.get("sandboxes")
        if not isinstance(sandboxes, list):
            raise Internal("the server's sandbox list has no 'sandboxes' array")
        return sandboxes

    async def get(self, ref: str) -> dict[str, Any]:
        """``GET /v1/sandboxes/{ref}``: the Sandbox named by id or name."""
        return _dict(await self.request("GET", _sandbox_path(ref)))

    async def delete(self, ref: str) -> None:
        """``DELETE /v1/sandboxes/{ref}``: terminate it (idempotent)."""
        await self.request("DELETE", _sandbox_path(ref))

    async def run(
        self,
        ref: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout_secs: int | None = None,
    ) -> RunResult:
        """``POST /v1/sandboxes/{ref}/run``: run ``argv`` to completion and return its output.

        ``argv`` is executed directly (no shell unless ``argv[0]`` is one); ``env`` is merged over
        the sandbox's own; ``cwd`` defaults to ``/sandbox/home``; ``timeout_secs`` kills the
        command after that many seconds (the server's default when omitted).
        """
        body: dict[str, Any] = {"argv": list(argv)}
        if env is not None:
            body["env"] = dict(env)
        if cwd is not None:
            body["cwd"] = cwd
        if stdin is not None:
            body["stdin"] = base64.b64encode(stdin).decode("ascii")
        if timeout_secs is not None:
            body["timeout_secs"] = timeout_secs
        return RunResult.from_wire(_dict(await self.request("POST", _sandbox_path(ref) + "/run", json=body)))

    async def node(self) -> dict[str, Any]:
        """``GET /v1/node``: the NodeStatus (a node server only; a gateway answers 404)."""
        return _dict(await self.request("GET", "/v1/node"))

    async def cordon(self, cordoned: bool = True) -> dict[str, Any]:
        """``POST /v1/node/cordon``: stop (``True``) or resume (``False``) taking new sandboxes."""
        return _dict(await self.request("POST", "/v1/node/cordon", json={"cordoned": cordoned}))


def _sandbox_path(ref: str) -> str:
    # A ref is an id or a name; quoting keeps a name from ever reaching another route.
    return "/v1/sandboxes/" + quote(ref, safe="")


def _decode_json(resp: Response, *, strict: bool) -> Any:
    try:
        return jsonlib.loads(resp.body)
    except ValueError as exc:
        if strict:
            raise Internal(f"the server sent invalid JSON (HTTP {resp.status}): {exc}") from exc
        return None


def _dict(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise Internal(f"the server answered {type(body).__name__} where a JSON object was expected")
    return body
