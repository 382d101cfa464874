"""``sandbox-cli``: the command line of the sandbox service, over the async SDK.

Output: aligned tables or ``key: value`` lines for people, the server's JSON with ``--json``.
Errors are printed as ``code: message`` on stderr. Exit status: 0 on success, 1 for a failed
request (including an unreachable server), 2 for bad usage; ``run`` exits with the command's.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import click

from sbx.api.errors import InvalidRequest, SandboxError
from sbx.client import AsyncClient, RunResult
from sbx.client._transport import AiohttpTransport, Endpoint, resolve_endpoint

T = TypeVar("T")

#: Exit status of ``run`` when the command timed out (as coreutils ``timeout`` does).
EXIT_TIMED_OUT = 124


@dataclass(frozen=True)
class _Options:
    endpoint: Endpoint
    as_json: bool


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--url",
    metavar="URL",
    help="Server address: unix:///path/to.sock or http(s)://host:port. "
    "Default: $SANDBOX_URL, else unix:///run/sandboxd.sock.",
)
@click.option("--token", metavar="TOKEN", help="Bearer token. Default: $SANDBOX_TOKEN.")
@click.option("--json", "as_json", is_flag=True, help="Print the server's JSON instead of tables.")
@click.version_option(package_name="sbx", prog_name="sandbox-cli")
@click.pass_context
def main(ctx: click.Context, url: str | None, token: str | None, as_json: bool) -> None:
    """Create sandboxes and run commands in them."""
    try:
        endpoint = resolve_endpoint(url, token)
    except InvalidRequest as exc:
        raise click.BadParameter(exc.message, param_hint="'--url' / SANDBOX_URL") from None
    ctx.obj = _Options(endpoint, as_json)


# -- commands ------------------------------------------------------------------------------------


@main.command()
@click.option("--name", help="Unique among live sandboxes.")
@click.option("--image", help="Image reference. Default: the server's default image.")
@click.option("--cpus", type=click.IntRange(min=1), help="vCPUs. Default: the server's.")
@click.option("--memory-mb", type=click.IntRange(min=1), help="Memory in MiB. Default: the server's.")
@click.option("--disk-mb", type=click.IntRange(min=1), help="Disk in MiB. Default: the server's.")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="Label; repeatable.")
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE", help="Environment variable; repeatable.")
@click.pass_obj
def create(
    opts: _Options,
    name: str | None,
    image: str | None,
    cpus: int | None,
    memory_mb: int | None,
    disk_mb: int | None,
    labels: tuple[str, ...],
    env: tuple[str, ...],
) -> None:
    """Create a sandbox and print its id."""
    fields: dict[str, Any] = {
        key: value
        for key, value in (
            ("name", name),
            ("image", image),
            ("cpus", cpus),
            ("memory_mb", memory_mb),
            ("disk_mb", disk_mb),
        )
        if value is not None
    }
    if labels:
        fields["labels"] = _pairs(labels, "--label")
    if env:
        fields["env"] = _pairs(env, "--env")
    sandbox = _call(opts, lambda client: client.create(**fields))
    if opts.as_json:
        _print_json(sandbox)
    else:
        click.echo(sandbox.get("id", ""))


@main.command(name="ls")
@click.option(
    "--label", "labels", multiple=True, metavar="KEY=VALUE", help="Only with this label; repeatable."
)
@click.pass_obj
def list_sandboxes(opts: _Options, labels: tuple[str, ...]) -> None:
    """List sandboxes, newest first (terminated ones until the server forgets them)."""
    wanted = _pairs(labels, "--label")
    sandboxes = _call(opts, lambda client: client.list(labels=wanted))
    if opts.as_json:
        _print_json({"sandboxes": sandboxes})
        return
    columns = ("id", "name", "state", "image", "cpus", "memory_mb", "disk_mb", "created_at")
    _print_table(columns, [[_cell(s.get(c)) for c in columns] for s in sandboxes])


@main.command()
@click.argument("ref")
@click.pass_obj
def get(opts: _Options, ref: str) -> None:
    """Show one sandbox (REF is an id or a name)."""
    sandbox = _call(opts, lambda client: client.get(ref))
    if opts.as_json:
        _print_json(sandbox)
    else:
        _print_fields(sandbox)


@main.command()
@click.argument("ref")
@click.pass_obj
def rm(opts: _Options, ref: str) -> None:
    """Terminate a sandbox (REF is an id or a name); terminating one twice is fine."""
    _call(opts, lambda client: client.delete(ref))
    if not opts.as_json:
        click.echo(ref)


@main.command()
@click.argument("ref")
@click.argument("argv", nargs=-1, required=True)
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE", help="Environment variable; repeatable.")
@click.option("--cwd", help="Absolute working directory in the guest. Default: /sandbox/home.")
@click.option("--timeout", "timeout_secs", type=click.IntRange(min=1), help="Kill after this many seconds.")
@click.pass_obj
def run(
    opts: _Options,
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
    variables = _pairs(env, "--env") if env else None
    result = _call(
        opts, lambda client: client.run(ref, argv, env=variables, cwd=cwd, timeout_secs=timeout_secs)
    )
    if opts.as_json:
        _print_json(_run_result_wire(result))
    else:
        # Bytes given to echo go to the binary stream untouched: output is shown as the command wrote it.
        click.echo(result.stdout, nl=False)
        click.echo(result.stderr, nl=False, err=True)
        if result.truncated:
            click.echo("sandbox-cli: output was truncated at 8 MiB per stream", err=True)
        if result.timed_out:
            click.echo("sandbox-cli: the command timed out and was killed", err=True)
    raise click.exceptions.Exit(_exit_status(result))


@main.command()
@click.option(
    "--cordon/--uncordon",
    "cordoned",
    default=None,
    help="Stop or resume taking new sandboxes (running ones carry on; a restart clears it).",
)
@click.pass_obj
def node(opts: _Options, cordoned: bool | None) -> None:
    """Show this node's status; optionally cordon or uncordon it."""
    if cordoned is None:
        status = _call(opts, lambda client: client.node())
    else:
        status = _call(opts, lambda client: client.cordon(cordoned))
    if opts.as_json:
        _print_json(status)
    else:
        _print_fields({k: v for k, v in status.items() if k != "capabilities"})


@main.command()
@click.pass_obj
def capabilities(opts: _Options) -> None:
    """Show what the server offers: capabilities, limits and network policy bounds."""
    caps = _call(opts, lambda client: client.capabilities())
    if opts.as_json:
        _print_json(caps)
        return
    flags = caps.get("capabilities") or {}
    shown = dict(caps)
    if isinstance(flags, dict):
        shown["capabilities"] = ", ".join(sorted(k for k, v in flags.items() if v)) or "(none)"
    _print_fields(shown)


# -- plumbing ------------------------------------------------------------------------------------


def _call(opts: _Options, fn: Callable[[AsyncClient], Awaitable[T]]) -> T:
    """Run one SDK call; a ``SandboxError`` becomes ``code: message`` on stderr and exit 1."""

    async def go() -> T:
        async with AsyncClient(transport=AiohttpTransport(opts.endpoint)) as client:
            return await fn(client)

    try:
        return asyncio.run(go())
    except SandboxError as exc:
        _fail(exc)


def _fail(exc: SandboxError) -> NoReturn:
    click.echo(f"{exc.code}: {exc.message}", err=True)
    raise click.exceptions.Exit(1)


def _pairs(values: Sequence[str], option: str) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict; a malformed one is a usage error (exit 2)."""
    pairs: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=f"'{option}'")
        pairs[key] = value
    return pairs


def _exit_status(result: RunResult) -> int:
    if result.timed_out:
        return EXIT_TIMED_OUT
    if result.exit_code < 0:
        # Killed by a signal: report it the way a shell does.
        return min(128 - result.exit_code, 255)
    return min(result.exit_code, 255)


def _run_result_wire(result: RunResult) -> dict[str, Any]:
    return {
        "exit_code": result.exit_code,
        "stdout": base64.b64encode(result.stdout).decode("ascii"),
        "stderr": base64.b64encode(result.stderr).decode("ascii"),
        "truncated": result.truncated,
        "timed_out": result.timed_out,
    }


def _print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, ensure_ascii=False))


def _cell(value: Any) -> str:
    """One value as table text: nothing for null, ``k=v`` pairs for objects, commas for arrays."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        if all(not isinstance(v, Mapping | list) for v in value.values()):
            return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if isinstance(value, list):
        return ", ".join(_cell(v) if not isinstance(v, Mapping) else json.dumps(v) for v in value)
    return str(value)


def _print_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    headers = [c.upper() for c in columns]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _print_fields(obj: Mapping[str, Any]) -> None:
    width = max((len(k) for k in obj), default=0)
    for key, value in obj.items():
        click.echo(f"{key + ':':<{width + 1}} {_cell(value)}".rstrip())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
