"""``run`` (to completion, output at the end) and ``exec`` (background process, output streamed)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import signal
import sys
from collections.abc import Awaitable

import click

from sbx.api.errors import SandboxError
from sbx.cli._common import (
    EXIT_TIMED_OUT,
    Options,
    call,
    exit_status,
    pairs,
    pass_options,
    print_json,
    signal_name,
)
from sbx.cli._stdin import stdin_chunks
from sbx.client import AsyncClient, Process, RunResult

#: Local signals passed on to the remote process by ``exec``.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

env_option = click.option(
    "--env", "env", multiple=True, metavar="NAME=VALUE", help="Environment variable; repeatable."
)
cwd_option = click.option("--cwd", help="Absolute working directory in the guest. Default: /sandbox/home.")


@click.command()
@click.argument("ref")
@click.argument("argv", nargs=-1, required=True)
@env_option
@cwd_option
@click.option("--timeout", "timeout_secs", type=click.IntRange(min=1), help="Kill after this many seconds.")
@pass_options
def run(
    opts: Options,
    ref: str,
    argv: tuple[str, ...],
    env: tuple[str, ...],
    cwd: str | None,
    timeout_secs: int | None,
) -> None:
    """Run a command to completion: sandbox-cli run REF -- ARGV...

    Prints the command's stdout and stderr as they are and exits with its exit code
    (124 when it timed out).
    """
    variables = pairs(env, "--env") if env else None

    async def go(client: AsyncClient) -> RunResult:
        sandbox = await client.sandboxes.get(ref)
        return await sandbox.run(argv, env=variables, cwd=cwd, timeout_secs=timeout_secs)

    result = call(opts, go)
    if opts.as_json:
        print_json(result)
    else:
        # Bytes given to echo go to the binary stream untouched: output is shown as the command wrote it.
        click.echo(result.stdout, nl=False)
        click.echo(result.stderr, nl=False, err=True)
        if result.truncated:
            click.echo("sandbox-cli: output was truncated at 8 MiB per stream", err=True)
        if result.timed_out:
            click.echo("sandbox-cli: the command timed out and was killed", err=True)
    raise click.exceptions.Exit(EXIT_TIMED_OUT if result.timed_out else exit_status(result.exit_code))


@click.command(name="exec")
@click.argument("ref")
@click.argument("argv", nargs=-1, required=True)
@env_option
@cwd_option
@click.option("-d", "--detach", is_flag=True, help="Start it and print its pid; do not follow it.")
@click.option(
    "--stdin/--no-stdin",
    "forward_stdin",
    default=True,
    help="Forward this program's stdin to the process (default), closing it at end of input.",
)
@pass_options
def exec_(
    opts: Options,
    ref: str,
    argv: tuple[str, ...],
    env: tuple[str, ...],
    cwd: str | None,
    detach: bool,
    forward_stdin: bool,
) -> None:
    """Start a command in the background and follow it: sandbox-cli exec REF -- ARGV...

    Its output is streamed as it is produced, stdin is forwarded, Ctrl-C (and TERM, HUP) are
    passed on to it, and the exit status is the command's. With --json the output is the
    server's stream: one JSON object per line ({stream, data} in base64, then {exit_code}).
    """
    variables = pairs(env, "--env") if env else None

    async def go(client: AsyncClient) -> int:
        sandbox = await client.sandboxes.get(ref)
        proc = await sandbox.start_process(argv, env=variables, cwd=cwd)
        if detach:
            if opts.as_json:
                print_json(proc.info)
            else:
                click.echo(proc.pid)
            return 0
        return await follow(proc, opts.as_json, forward_stdin)

    raise click.exceptions.Exit(call(opts, go))


async def follow(proc: Process, as_json: bool, forward_stdin: bool) -> int:
    """Stream ``proc``'s output to ours until it exits; its exit status."""
    loop = asyncio.get_running_loop()
    stdout = sys.stdout.buffer
    stderr = sys.stderr.buffer
    pending: set[asyncio.Task[bool]] = set()

    def forward_signal(signum: int) -> None:
        task = loop.create_task(_quietly(proc.signal(signal_name(signum))))
        pending.add(task)
        task.add_done_callback(pending.discard)

    for signum in FORWARDED_SIGNALS:
        loop.add_signal_handler(signum, forward_signal, signum)
    feeder = loop.create_task(_feed_stdin(proc)) if forward_stdin else None
    try:
        async for event in proc.output():
            if as_json:
                line = {"stream": event.stream, "data": base64.b64encode(event.data).decode("ascii")}
                stdout.write(json.dumps(line).encode() + b"\n")
                stdout.flush()
            else:
                out = stdout if event.stream == "stdout" else stderr
                out.write(event.data)
                out.flush()
    finally:
        for signum in FORWARDED_SIGNALS:
            loop.remove_signal_handler(signum)
        if feeder is not None:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeder
    code = proc.exit_code if proc.exit_code is not None else -1
    if as_json:
        stdout.write(json.dumps({"exit_code": code}).encode() + b"\n")
        stdout.flush()
    return exit_status(code)


async def _feed_stdin(proc: Process) -> None:
    chunks = stdin_chunks(sys.stdin.buffer)
    while chunk := await chunks.get():
        if not await _quietly(proc.write_stdin(chunk)):
            return
    await _quietly(proc.close_stdin())


async def _quietly(pending_call: Awaitable[None]) -> bool:
    """Await a best-effort call; False if it failed (the process may have exited meanwhile)."""
    try:
        await pending_call
    except SandboxError:
        return False
    return True
