"""``ports ls|public|private|open REF PORT``: a sandbox's TCP ports on URLs of their own, through a gateway run with
``--ports-domain`` (capability ``exposed_ports``; docs/ports.md).

``ls`` is a table (PORT URL PUBLIC LISTENING); ``public`` and ``private`` change who may open a port and print
its line; ``open`` prints a token URL a browser opens without a key (``--ttl`` seconds, default one hour). A
server without the capability answers ``unsupported: ...`` (exit 1), as the gateway says it.
"""

from __future__ import annotations

from collections.abc import Sequence

import click

from sbx.api.ports import DEFAULT_TOKEN_TTL_SECS, MAX_TOKEN_TTL_SECS, Port, PortToken
from sbx.cli._common import Options, call, cell, pass_options, print_json, print_table
from sbx.client import AsyncClient

COLUMNS = ("port", "url", "public", "listening")

port_argument = click.argument("port", type=click.IntRange(1, 65535))


def _rows(ports: Sequence[Port]) -> list[list[str]]:
    return [[str(p.port), p.url, cell(p.public), cell(p.listening)] for p in ports]


@click.group()
def ports() -> None:
    """A sandbox's ports on URLs of their own (a gateway with --ports-domain).

    A port is private until made public: its URL opens with the owner's key, or in a browser with the token URL
    that `ports open` prints. A public port opens for anyone who has its URL.
    """


@ports.command(name="ls")
@click.argument("ref")
@pass_options
def list_ports(opts: Options, ref: str) -> None:
    """List REF's ports: those its guest listens on and those made public."""

    async def go(client: AsyncClient) -> list[Port]:
        return await (await client.sandboxes.get(ref)).ports.list()

    found = call(opts, go)
    if opts.as_json:
        print_json({"ports": found})
    else:
        print_table(COLUMNS, _rows(found))


def _set_public(opts: Options, ref: str, port: int, public: bool) -> None:
    async def go(client: AsyncClient) -> Port:
        return await (await client.sandboxes.get(ref)).ports.public(port, public)

    changed = call(opts, go)
    if opts.as_json:
        print_json(changed)
    else:
        print_table(COLUMNS, _rows([changed]))


@ports.command(name="public")
@click.argument("ref")
@port_argument
@pass_options
def make_public(opts: Options, ref: str, port: int) -> None:
    """Make PORT of REF public: anyone who has its URL may open it, without a key."""
    _set_public(opts, ref, port, True)


@ports.command(name="private")
@click.argument("ref")
@port_argument
@pass_options
def make_private(opts: Options, ref: str, port: int) -> None:
    """Make PORT of REF private again: its URL needs the owner's key or a token URL (`ports open`)."""
    _set_public(opts, ref, port, False)


@ports.command(name="open")
@click.argument("ref")
@port_argument
@click.option("--ttl", "ttl_secs", type=click.IntRange(1, MAX_TOKEN_TTL_SECS), default=None, metavar="SECS",
              help=f"How long the token URL works, 1 to {MAX_TOKEN_TTL_SECS} s. "
                   f"Default: {DEFAULT_TOKEN_TTL_SECS}.")  # fmt: skip
@pass_options
def open_port(opts: Options, ref: str, port: int, ttl_secs: int | None) -> None:
    """Print a token URL of PORT of REF: a browser opening it gets that one port without a key (the token
    becomes a cookie of that host) until it expires. Anyone holding the URL can use it: hand it on with care."""

    async def go(client: AsyncClient) -> PortToken:
        return await (await client.sandboxes.get(ref)).ports.token(port, ttl_secs)

    made = call(opts, go)
    if opts.as_json:
        print_json(made)
    else:
        click.echo(made.url)
        click.echo(f"expires {made.expires_at}", err=True)
