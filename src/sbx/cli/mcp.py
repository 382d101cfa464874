"""``mcp``: serve the sandboxes to an agent host over the Model Context Protocol (docs/mcp.md)."""

from __future__ import annotations

import asyncio

import click

from sbx.api.errors import SandboxError
from sbx.cli._common import Options, pass_options
from sbx.mcp.output import DEFAULT_MAX_OUTPUT_BYTES, MAX_OUTPUT_BYTES_CEILING
from sbx.mcp.server import parse_http_address, serve_http, serve_stdio
from sbx.mcp.session import DEFAULT_IDLE_TIMEOUT_SECS, SessionConfig
from sbx.web.logs import setup_logging


@click.command(name="mcp")
@click.option(
    "--http",
    "http_address",
    metavar="[HOST:]PORT",
    help="Serve streamable HTTP at http://HOST:PORT/mcp instead of stdio. HOST must be loopback "
    "(default 127.0.0.1).",
)
@click.option(
    "--idle-timeout",
    "idle_timeout_secs",
    type=click.IntRange(min=0),
    default=DEFAULT_IDLE_TIMEOUT_SECS,
    show_default=True,
    help="Seconds unused before a sandbox of this session is terminated by the server (within its limit); "
    "0: the server's default.",
)
@click.option(
    "--max-output-bytes",
    type=click.IntRange(min=1024, max=MAX_OUTPUT_BYTES_CEILING),
    default=DEFAULT_MAX_OUTPUT_BYTES,
    show_default=True,
    help="Cap of each text field of a tool answer (per output stream), in bytes.",
)
@click.option(
    "--keep",
    is_flag=True,
    help="Leave this session's sandboxes (to their idle timeout) and snapshots when it ends.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="Logs go to stderr as JSON lines (stdout is the protocol).",
)
@pass_options
def mcp(
    opts: Options,
    http_address: str | None,
    idle_timeout_secs: int,
    max_output_bytes: int,
    keep: bool,
    log_level: str,
) -> None:
    """Serve sandboxes to an MCP host (stdio by default): create, run, files, processes, snapshots.

    The server is the one of --url / SANDBOX_URL, with the key of --token / SANDBOX_TOKEN.
    """
    address = None
    if http_address is not None:
        try:
            address = parse_http_address(http_address)
        except SandboxError as exc:
            raise click.BadParameter(exc.message, param_hint="'--http'") from None
    setup_logging(log_level)
    config = SessionConfig(
        endpoint=opts.endpoint,
        idle_timeout_secs=idle_timeout_secs,
        max_output_bytes=max_output_bytes,
        keep=keep,
    )
    if address is None:
        asyncio.run(serve_stdio(config))
    else:
        asyncio.run(serve_http(config, *address))
