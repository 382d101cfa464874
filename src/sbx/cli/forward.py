"""``forward``: listen on a local port and tunnel each connection to a port inside a sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import click

from sbx.api.errors import SandboxError, Unsupported
from sbx.cli._common import Options, call, pass_options
from sbx.client import AsyncClient, Sandbox

#: Bytes copied per read in each direction.
COPY_CHUNK_BYTES = 64 * 1024


def parse_ports(text: str) -> tuple[int, int]:
    """``LOCAL:REMOTE`` or ``PORT`` (the same on both sides) as ``(local, remote)``.

    LOCAL may be 0 (any free port, printed when listening); REMOTE is 1 to 65535.
    """
    local_text, sep, remote_text = text.partition(":")
    if not sep:
        remote_text = local_text
    try:
        local, remote = int(local_text), int(remote_text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not LOCAL:REMOTE (ports, e.g. 8000:80)") from None
    if not 0 <= local <= 65535 or not 1 <= remote <= 65535:
        raise click.BadParameter(f"{text!r}: LOCAL is 0 to 65535 and REMOTE 1 to 65535")
    return local, remote


@click.command()
@click.argument("ref")
@click.argument("ports", metavar="LOCAL:REMOTE")
@click.option("--address", default="127.0.0.1", show_default=True, help="Local address to listen on.")
@pass_options
def forward(opts: Options, ref: str, ports: str, address: str) -> None:
    """Forward a local port to a port on the sandbox's loopback: sandbox-cli forward REF 8000:80

    Each connection to ADDRESS:LOCAL opens a tunnel to 127.0.0.1:REMOTE inside the sandbox;
    half-closes pass through. Runs until interrupted (Ctrl-C), then exits 0.
    """
    local, remote = parse_ports(ports)

    async def go(client: AsyncClient) -> None:
        caps = await client.capabilities()
        if not caps.capabilities.get("tunnel"):
            raise Unsupported("this server does not offer tunnels (capability 'tunnel' is off)")
        sandbox = await client.sandboxes.get(ref)
        server = await asyncio.start_server(
            lambda r, w: _serve(sandbox, remote, r, w), host=address, port=local
        )
        bound = server.sockets[0].getsockname()
        click.echo(f"Forwarding {bound[0]}:{bound[1]} -> {sandbox.id}:{remote} (Ctrl-C to stop)", err=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        async with server:
            await stop.wait()

    try:
        call(opts, go)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {address}:{local}: {exc.strerror}") from None


async def _serve(
    sandbox: Sandbox, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        tunnel = await sandbox.tunnel(port)
    except SandboxError as exc:
        click.echo(f"{exc.code}: {exc.message}", err=True)
        writer.close()
        return
    async with tunnel:
        await asyncio.gather(pipe(reader, tunnel.writer), pipe(tunnel.reader, writer))
    writer.close()


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until ``reader`` ends, then half-close ``writer`` (or close it if it cannot)."""
    try:
        while data := await reader.read(COPY_CHUNK_BYTES):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        else:
            writer.close()
    except (ConnectionError, OSError):
        writer.close()
    finally:
        with contextlib.suppress(Exception):
            await writer.drain()
