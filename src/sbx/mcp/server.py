"""The MCP server: the official ``mcp`` SDK's low-level server bound to the tools, over stdio or streamable HTTP.

Every tool call is answered, never crashes the server: its arguments are read strictly against the tool's
schema (``invalid_request`` naming the argument), a failure of the service comes back as a tool error
(``isError``) whose text is ``code: message`` and whose structured content is ``{"error": {"code",
"message"}}`` (the spec's codes), and an unexpected exception is logged and answered ``internal``. A success
carries the answer as structured content and as text: for most tools the answer's JSON (for hosts that read
only text); for the tools that carry text (``read_file``, ``run_command``, ``read_process_output``) that text
itself, a block per output stream, then a short status note (the tool's ``ToolSpec.text``), so the model
reads a file's lines rather than a JSON string of escapes. The structured content is the same either way.

Logs go to stderr (stdout is the protocol on stdio): one line per tool call with its name, outcome and
duration; never its arguments (they hold file contents and environment values) or the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Protocol

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from msgspec import Struct

from sbx.api.codec import convert_request, to_builtins
from sbx.api.errors import Internal, InvalidRequest, Refused, SandboxError
from sbx.mcp import tools as t
from sbx.mcp.session import Session, SessionConfig
from sbx.net.loopback import is_loopback

log = logging.getLogger(__name__)

INSTRUCTIONS = (
    "Tools to run code in isolated Linux sandboxes (gVisor). Create one with create_sandbox (its id is what "
    "the other tools take), run commands with run_command, keep servers running with start_process and "
    "read_process_output, move text in and out with read_file and write_file, save and copy a sandbox with "
    "snapshot_sandbox and fork_sandbox, and terminate_sandbox when done. Commands run as an unprivileged user "
    "in /sandbox/home. Sandboxes this session made are terminated when it ends."
)


def _version() -> str:
    try:
        return version("sbx")
    except PackageNotFoundError:  # pragma: no cover - a source tree without installed metadata
        return "0"


def tool_list() -> list[types.Tool]:
    """Every tool as the host sees it: name, title, description, input and output schemas, hints."""
    return [
        types.Tool(
            name=spec.name,
            title=spec.title,
            description=spec.description,
            input_schema=t.json_schema(spec.args),
            output_schema=t.json_schema(spec.result),
            annotations=types.ToolAnnotations(
                title=spec.title,
                read_only_hint=spec.read_only,
                destructive_hint=spec.destructive,
                idempotent_hint=spec.idempotent,
                open_world_hint=False,
            ),
        )
        for spec in t.TOOLS
    ]


def error_result(exc: SandboxError) -> types.CallToolResult:
    """A failed call: ``code: message`` as text, ``{"error": {"code", "message"}}`` as structured content."""
    body = t.ToolError(error=t.ErrorDetail(code=exc.code, message=exc.message))
    return types.CallToolResult(
        content=[types.TextContent(text=f"{exc.code}: {exc.message}")],
        structured_content=to_builtins(body),
        is_error=True,
    )


def success_result(answer: Any, text: t.TextRenderer | None = None) -> types.CallToolResult:
    """A successful call: the answer as structured content (always the same shape, the output schema's), and
    as text the blocks ``text`` renders from it, or its JSON when there is no renderer or it has nothing
    better (a base64 file)."""
    data = to_builtins(answer)
    blocks = text(answer) if text is not None else None
    content: list[types.ContentBlock]
    if blocks is None:
        content = [types.TextContent(text=json.dumps(data, ensure_ascii=False))]
    else:
        content = [_text_content(block) for block in blocks]
    return types.CallToolResult(content=content, structured_content=data)


def _text_content(block: t.TextBlock) -> types.TextContent:
    """A block as MCP text content; a stream's block is marked ``_meta: {"stream": "stdout"}`` (or stderr) so a
    host can tell the streams apart without parsing the status note."""
    if block.stream is None:
        return types.TextContent(text=block.text)
    # ``_meta`` (the wire name) is the keyword the type checks accept; ``meta`` would work only at run time.
    return types.TextContent(text=block.text, _meta={"stream": block.stream})


class ToolHandlers(Protocol):
    """What ``call_tool`` needs of a session: the coroutine implementing a tool (``Session`` is one)."""

    def handler(self, name: str) -> Callable[[Any], Awaitable[Struct]]: ...


async def call_tool(
    session: ToolHandlers, name: str, arguments: dict[str, Any] | None
) -> types.CallToolResult:
    """Run tool ``name``; every outcome but an unknown name is a ``CallToolResult``."""
    spec = t.TOOLS_BY_NAME.get(name)
    if spec is None:
        # The MCP spec makes an unknown tool a protocol error, not a tool error.
        raise MCPError(
            types.INVALID_PARAMS, f"unknown tool {name!r}; the tools are {', '.join(t.TOOLS_BY_NAME)}"
        )
    started = time.monotonic()
    outcome = "ok"
    try:
        if arguments is not None and not isinstance(arguments, dict):
            raise InvalidRequest("the arguments must be a JSON object")
        args = convert_request(arguments or {}, spec.args)
        return success_result(await session.handler(name)(args), spec.text)
    except SandboxError as exc:
        outcome = exc.code
        return error_result(exc)
    except Exception as exc:  # a bug in one call must not end the session
        outcome = "internal"
        log.exception("tool call failed unexpectedly", extra={"tool": name})
        return error_result(Internal(f"the MCP server failed unexpectedly in {name}: {exc!r}"))
    finally:
        log.info(
            "tool call",
            extra={"tool": name, "outcome": outcome, "secs": round(time.monotonic() - started, 3)},
        )


def build_server(session: Session) -> Server[Any]:
    """The low-level MCP server answering ``tools/list`` and ``tools/call`` for ``session``."""
    listed = tool_list()

    async def on_list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        return await call_tool(session, params.name, params.arguments)

    return Server(
        "sbx",
        version=_version(),
        title="sbx sandboxes",
        instructions=INSTRUCTIONS,
        on_list_tools=on_list_tools,
        on_call_tool=on_call_tool,
    )


def _noted(signum: int, frame: object) -> None:
    log.info("signal received", extra={"signal": signal.Signals(signum).name})


def check_listen_host(host: str) -> None:
    """Refuse (``Refused``) to listen anywhere but loopback: the server has no authentication of its own and
    acts with the key it was given, so whoever reaches it could use that key."""
    if not is_loopback(host):
        raise Refused(
            f"refusing to listen on {host!r}: the MCP server has no authentication of its own and acts with "
            "your sandbox key, so it listens on loopback only (127.0.0.1, ::1 or localhost); reach it from "
            "another machine through an SSH tunnel (ssh -L)"
        )


async def _closing(session: Session) -> None:
    """End the session even when the task running it is being cancelled (a signal, the host leaving)."""
    closing = asyncio.ensure_future(session.close())
    while not closing.done():
        # A second signal during the clean-up cancels this wait, not the clean-up: wait again.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(closing)
    closing.result()


def _cancel_on_signals(task: asyncio.Task[Any]) -> None:
    """SIGTERM and SIGINT end the session cleanly (its clean-up runs) instead of killing the process."""
    loop = asyncio.get_running_loop()

    def stop(signum: signal.Signals) -> None:
        _noted(signum, None)
        task.cancel()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop, signum)


async def serve_stdio(config: SessionConfig) -> None:
    """Serve one session over stdin and stdout until the host closes stdin or sends SIGTERM/SIGINT."""
    session = Session(config)
    server = build_server(session)
    current = asyncio.current_task()
    assert current is not None
    _cancel_on_signals(current)
    log.info("mcp session started", extra={"session": session.id, "transport": "stdio"})
    try:
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())
    except asyncio.CancelledError:
        log.info("mcp session stopped by a signal", extra={"session": session.id})
    finally:
        await _closing(session)


async def serve_http(config: SessionConfig, host: str, port: int) -> None:
    """Serve streamable HTTP at ``http://host:port/mcp`` (loopback only) until SIGTERM/SIGINT; every client
    of it shares one session."""
    import uvicorn  # only this transport needs it

    check_listen_host(host)
    session = Session(config)
    server = build_server(session)
    authority = f"[{host}]" if ":" in host else host
    # DNS rebinding: only requests naming this loopback host (any port) and origins on it are served.
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[f"{authority}:*", "localhost:*", "127.0.0.1:*", "[::1]:*"],
        allowed_origins=[
            f"http://{authority}:*",
            "http://localhost:*",
            "http://127.0.0.1:*",
            "http://[::1]:*",
        ],
    )
    app = server.streamable_http_app(host=host, transport_security=security)
    uv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    # uvicorn stops on SIGTERM/SIGINT, then restores the handlers it found and raises the signal again: with
    # Python's defaults that would kill the process before the session's clean-up. Found handlers that only
    # note the signal let the clean-up run (and a second signal during it does not cut it short).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _noted)
    log.info(
        "mcp session started",
        extra={"session": session.id, "transport": "http", "url": f"http://{authority}:{port}/mcp"},
    )
    try:
        await uv.serve()
    finally:
        await _closing(session)


def parse_http_address(value: str) -> tuple[str, int]:
    """``PORT``, ``HOST:PORT`` or ``[V6]:PORT`` as ``(host, port)`` (host default 127.0.0.1); the host must be
    loopback (``Refused`` otherwise), the port 0 to 65535 (``InvalidRequest``)."""
    text = value.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "127.0.0.1", text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise InvalidRequest(f"{value!r}: write an IPv6 address in brackets, e.g. [::1]:8765")
    if not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise InvalidRequest(f"{value!r} is not PORT or HOST:PORT (e.g. 8765 or 127.0.0.1:8765)")
    check_listen_host(host)
    return host, int(port_text)
