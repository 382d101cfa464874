"""``shell``: an interactive terminal in a sandbox (a tty process, attached over ``sbx-stream/1``)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable

import click

from sbx.api import frames
from sbx.api.errors import SandboxError
from sbx.api.processes import LOGIN_SHELL
from sbx.cli._common import Options, call, exit_status, pass_options
from sbx.cli._stdin import stdin_chunks
from sbx.cli._terminal import raw_mode, terminal_size
from sbx.client import AsyncClient, Attachment

#: What ``shell`` runs without ARGV: bash when the image has it, else sh, as a login shell.
DEFAULT_SHELL = LOGIN_SHELL


@click.command()
@click.argument("ref")
@click.argument("argv", nargs=-1)
@click.option("--cwd", help="Absolute working directory in the guest. Default: /sandbox/home.")
@pass_options
def shell(opts: Options, ref: str, argv: tuple[str, ...], cwd: str | None) -> None:
    """Open an interactive terminal in a sandbox: sandbox-cli shell REF [-- ARGV...]

    Runs a login shell (bash if present, else sh), or ARGV, on a terminal the size of this one,
    follows window resizes, and exits with its exit status. The local terminal is put in raw
    mode while attached and restored afterwards.
    """
    stdin = sys.stdin
    if not stdin.isatty():
        raise click.UsageError("shell needs a terminal on stdin; for pipes use `sandbox-cli exec`")
    fd = stdin.fileno()
    command = argv or DEFAULT_SHELL

    async def go(client: AsyncClient) -> int:
        sandbox = await client.sandboxes.get(ref)
        rows, cols = terminal_size(fd)
        proc = await sandbox.start_process(command, cwd=cwd, tty=True, rows=rows, cols=cols)
        try:
            attachment = await proc.attach()
        except SandboxError:
            # Nobody will ever type into it: do not leave it waiting in the sandbox.
            with contextlib.suppress(SandboxError):
                await proc.kill()
            raise
        async with attachment:
            with raw_mode(fd):
                code = await interact(attachment, fd)
        return exit_status(code if code is not None else -1)

    raise click.exceptions.Exit(call(opts, go))


async def interact(attachment: Attachment, fd: int) -> int | None:
    """Pump keys to the process and its output to our terminal until it exits; its exit code.

    ``None`` when the server closed the stream without an exit frame.
    """
    loop = asyncio.get_running_loop()
    out = sys.stdout.buffer

    def on_resize() -> None:
        rows, cols = terminal_size(fd)
        loop.create_task(_ignore_errors(attachment.resize(rows, cols)))

    loop.add_signal_handler(signal.SIGWINCH, on_resize)
    keys = loop.create_task(_pump_keys(attachment))
    try:
        async for frame in attachment:
            if frame.type in (frames.STDOUT, frames.STDERR):
                out.write(frame.payload)
                out.flush()
            elif frame.type == frames.EXIT:
                break
    finally:
        loop.remove_signal_handler(signal.SIGWINCH)
        keys.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keys
    return attachment.exit_code


async def _pump_keys(attachment: Attachment) -> None:
    chunks = stdin_chunks(sys.stdin.buffer)
    while chunk := await chunks.get():
        await attachment.write_stdin(chunk)
    await attachment.close_stdin()


async def _ignore_errors(pending_call: Awaitable[None]) -> None:
    with contextlib.suppress(SandboxError):
        await pending_call
