"""``node``, ``capabilities`` and ``events``: what the server and a sandbox report."""

from __future__ import annotations

from typing import Any

import click

from sbx.api.codec import to_builtins
from sbx.cli._common import Options, call, cell, pass_options, print_fields, print_json, print_table
from sbx.client import AsyncClient, EventList

#: Event fields shown as their own columns; the rest go to DETAILS as k=v.
_EVENT_BASE = ("time", "type", "sandbox")


@click.command()
@click.option(
    "--cordon/--uncordon",
    "cordoned",
    default=None,
    help="Stop or resume taking new sandboxes (running ones carry on; a restart clears it).",
)
@pass_options
def node(opts: Options, cordoned: bool | None) -> None:
    """Show this node's status; optionally cordon or uncordon it."""
    if cordoned is None:
        status = call(opts, lambda client: client.node())
    else:
        status = call(opts, lambda client: client.cordon(cordoned))
    if opts.as_json:
        print_json(status)
    else:
        print_fields({k: v for k, v in to_builtins(status).items() if k != "capabilities"})


@click.command()
@pass_options
def capabilities(opts: Options) -> None:
    """Show what the server offers: capabilities, limits and network policy bounds."""
    caps = call(opts, lambda client: client.capabilities())
    if opts.as_json:
        print_json(caps)
        return
    shown = to_builtins(caps)
    shown["capabilities"] = ", ".join(sorted(k for k, v in caps.capabilities.items() if v)) or "(none)"
    print_fields(shown)


@click.command()
@click.argument("ref")
@pass_options
def events(opts: Options, ref: str) -> None:
    """Show a sandbox's audit events, oldest first (REF: an id, or the name of a live one)."""

    async def go(client: AsyncClient) -> EventList:
        # By id without a lookup: a forgotten terminated sandbox's events are still answered.
        return await client.sandboxes.events(ref)

    found = call(opts, go)
    if opts.as_json:
        print_json(found)
        return
    rows = [[cell(e.get("time")), cell(e.get("type")), _details(e)] for e in found.events]
    print_table(("time", "type", "details"), rows)
    if found.truncated:
        click.echo("sandbox-cli: only the newest 5000 events were returned", err=True)


def _details(event: dict[str, Any]) -> str:
    return " ".join(f"{k}={cell(v)}" for k, v in event.items() if k not in _EVENT_BASE)
