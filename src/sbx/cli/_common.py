"""What every command shares: the global options, running an SDK call, errors, and output helpers.

Errors are printed as ``code: message`` on stderr with exit status 1 (``EXIT_FAILED``); usage
errors are click's, exit status 2.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import click

from sbx.api.codec import to_builtins
from sbx.api.errors import SandboxError, Unsupported
from sbx.api.sandboxes import Sandbox as SandboxInfo
from sbx.client import AsyncClient
from sbx.client._endpoint import Endpoint
from sbx.client._transport import AiohttpTransport

T = TypeVar("T")

#: Exit status for a failed request (including an unreachable server).
EXIT_FAILED = 1
#: Exit status of ``run`` when the command timed out (as coreutils ``timeout`` does).
EXIT_TIMED_OUT = 124


@dataclass(frozen=True)
class Options:
    """The global options, as the group resolved them."""

    endpoint: Endpoint
    as_json: bool


pass_options = click.make_pass_decorator(Options)


def call(opts: Options, fn: Callable[[AsyncClient], Awaitable[T]]) -> T:
    """Run ``fn(client)`` on a fresh loop; a ``SandboxError`` becomes ``code: message`` and exit 1.

    Ctrl-C raises ``KeyboardInterrupt`` out of the loop (click prints ``Aborted!``, exit 1).
    """

    async def go() -> T:
        async with AsyncClient(transport=AiohttpTransport(opts.endpoint)) as client:
            return await fn(client)

    try:
        return asyncio.run(go())
    except SandboxError as exc:
        fail(exc)


def fail(exc: SandboxError) -> NoReturn:
    """Print ``code: message`` on stderr and exit 1."""
    click.echo(f"{exc.code}: {exc.message}", err=True)
    raise click.exceptions.Exit(EXIT_FAILED)


async def require_capability(client: AsyncClient, flag: str, offer: str, instead: str) -> None:
    """``Unsupported`` unless the server's capabilities have ``flag`` on, before anything else is sent: a
    server that does not offer ``offer`` (e.g. "persistent sandboxes") would otherwise answer with a less
    telling error; ``instead`` says what the user can do then."""
    caps = await client.capabilities()
    if not caps.capabilities.get(flag):
        raise Unsupported(f"this server does not offer {offer} (capability {flag!r} is off): {instead}")


def state_text(info: SandboxInfo) -> str:
    """A sandbox's state for people: ``running``, or ``stopped (crash)`` with why a stopped one stopped."""
    if isinstance(info.stopped_reason, str):
        return f"{info.state} ({info.stopped_reason})"
    return info.state


def pairs(values: Sequence[str], option: str) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict; a malformed one is a usage error (exit 2)."""
    found: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=f"'{option}'")
        found[key] = value
    return found


def exit_status(exit_code: int) -> int:
    """A process's exit code as this program's exit status: a signal death (negative) as a shell
    reports it (128 + signal), everything clipped to 0..255."""
    if exit_code < 0:
        return min(128 - exit_code, 255)
    return min(exit_code, 255)


def signal_name(signum: int) -> str:
    """The API's name for a local signal (``INT``, ``TERM``, ``HUP``)."""
    return signal.Signals(signum).name.removeprefix("SIG")


def print_json(obj: Any) -> None:
    """``obj`` (a wire type or plain values) as indented JSON on stdout."""
    click.echo(json.dumps(to_builtins(obj), indent=2, ensure_ascii=False))


def cell(value: Any) -> str:
    """One value as table text: nothing for null, ``k=v`` pairs for objects, commas for arrays."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        if all(not isinstance(v, Mapping | list) for v in value.values()):
            return ", ".join(f"{k}={cell(v)}" for k, v in value.items())
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if isinstance(value, list):
        return ", ".join(cell(v) if not isinstance(v, Mapping) else json.dumps(v) for v in value)
    return str(value)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """An aligned table with upper-case headers, two spaces between columns."""
    headers = [c.upper() for c in columns]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        click.echo("  ".join(c.ljust(width) for c, width in zip(row, widths, strict=True)).rstrip())


def print_fields(value: Any) -> None:
    """``key: value`` lines of an object (a wire type or a mapping), values aligned."""
    obj: Mapping[str, Any] = to_builtins(value)
    width = max((len(k) for k in obj), default=0)
    for key, item in obj.items():
        click.echo(f"{key + ':':<{width + 1}} {cell(item)}".rstrip())
