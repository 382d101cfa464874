"""``suspend``, ``resume``, ``stop``, ``snapshot``, ``snapshots ls|rm`` and ``volumes ls|create|rm``: state that
outlives a run (see docs/snapshots.md and docs/volumes.md). Forks: ``create --from-snapshot ID``; persistent
sandboxes: ``create --persistent --name N``."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence

import click

from sbx.api.codec import to_builtins
from sbx.api.node import PERSISTENT
from sbx.api.snapshots import Snapshot
from sbx.cli._common import (
    Options,
    call,
    cell,
    pass_options,
    print_fields,
    print_json,
    print_table,
    require_capability,
    state_text,
)
from sbx.client import AsyncClient, Sandbox

SNAPSHOT_COLUMNS = ("id", "sandbox", "kind", "bytes", "created_at", "scheduled")
VOLUME_COLUMNS = ("name", "size_mb", "attached_to", "created_at")


def _list(
    opts: Options,
    key: str,
    columns: tuple[str, ...],
    fetch: Callable[[AsyncClient], Awaitable[Sequence[object]]],
) -> None:
    found = call(opts, fetch)
    if opts.as_json:
        print_json({key: found})
    else:
        rows = [to_builtins(item) for item in found]
        print_table(columns, [[cell(item.get(c)) for c in columns] for item in rows])


def _remove_each(
    opts: Options, names: tuple[str, ...], remove: Callable[[AsyncClient, str], Awaitable[None]]
) -> None:
    """Remove one by one, printing each name once removed; the first failure ends the command."""
    for name in names:
        call(opts, functools.partial(_remove_one, remove=remove, name=name))
        click.echo(name)


async def _remove_one(
    client: AsyncClient, remove: Callable[[AsyncClient, str], Awaitable[None]], name: str
) -> None:
    await remove(client, name)


def _show_sandbox(opts: Options, sandbox: Sandbox) -> None:
    if opts.as_json:
        print_json(sandbox.info)
    else:
        click.echo(f"{sandbox.id}: {state_text(sandbox.info)}")


@click.command()
@click.argument("ref")
@pass_options
def suspend(opts: Options, ref: str) -> None:
    """Save and stop sandbox REF: memory, processes and disk kept, no CPU or memory used.

    Refused while a process started through the API runs.
    """

    async def go(client: AsyncClient) -> Sandbox:
        return await (await client.sandboxes.get(ref)).suspend()

    _show_sandbox(opts, call(opts, go))


@click.command()
@click.argument("ref")
@pass_options
def resume(opts: Options, ref: str) -> None:
    """Bring suspended sandbox REF back as it was, or start stopped persistent sandbox REF from its disk."""

    async def go(client: AsyncClient) -> Sandbox:
        return await (await client.sandboxes.get(ref)).resume()

    _show_sandbox(opts, call(opts, go))


@click.command()
@click.argument("ref")
@pass_options
def stop(opts: Options, ref: str) -> None:
    """Stop persistent sandbox REF: its processes end and its memory is freed, its disk, volumes, name and
    labels are kept. `resume`, or any command that needs it (run, exec, cp, ...), starts it again.

    Refused for a sandbox created without --persistent (`rm` terminates that one).
    """

    async def go(client: AsyncClient) -> Sandbox:
        await require_capability(
            client, PERSISTENT, "persistent sandboxes", "`suspend` or `rm` the sandbox instead"
        )
        return await (await client.sandboxes.get(ref)).stop()

    _show_sandbox(opts, call(opts, go))


@click.command()
@click.argument("ref")
@click.option("--disk", "kind", flag_value="disk", help="Files only (the sandbox keeps running meanwhile).")
@click.option(
    "--memory", "kind", flag_value="memory", default=True, help="Everything, processes included (default)."
)
@pass_options
def snapshot(opts: Options, ref: str, kind: str) -> None:
    """Snapshot sandbox REF and print the snapshot's id; fork it with `create --from-snapshot ID`."""

    async def go(client: AsyncClient) -> Snapshot:
        return await (await client.sandboxes.get(ref)).snapshot(kind)

    taken = call(opts, go)
    if opts.as_json:
        print_json(taken)
    else:
        click.echo(taken.id)


@click.group()
def snapshots() -> None:
    """List and delete snapshots."""


@snapshots.command(name="ls")
@pass_options
def list_snapshots(opts: Options) -> None:
    """List the server's snapshots, newest first."""
    _list(opts, "snapshots", SNAPSHOT_COLUMNS, lambda client: client.snapshots.list())


@snapshots.command(name="rm")
@click.argument("ids", metavar="ID...", nargs=-1, required=True)
@pass_options
def remove_snapshots(opts: Options, ids: tuple[str, ...]) -> None:
    """Delete snapshots; prints each ID as it goes, stops at the first failure."""
    _remove_each(opts, ids, lambda client, snapshot_id: client.snapshots.delete(snapshot_id))


@click.group()
def volumes() -> None:
    """Create, list and delete volumes; mount them with `create --volume NAME:PATH[:ro]`."""


@volumes.command(name="ls")
@pass_options
def list_volumes(opts: Options) -> None:
    """List the server's volumes."""
    _list(opts, "volumes", VOLUME_COLUMNS, lambda client: client.volumes.list())


@volumes.command(name="create")
@click.argument("name")
@click.option(
    "--size-mb", type=click.IntRange(min=1), help="Size in MiB. Default: the server's default disk."
)
@pass_options
def create_volume(opts: Options, name: str, size_mb: int | None) -> None:
    """Create an empty volume NAME."""
    made = call(opts, lambda client: client.volumes.create(name, size_mb))
    if opts.as_json:
        print_json(made)
    else:
        print_fields(made)


@volumes.command(name="rm")
@click.argument("names", metavar="NAME...", nargs=-1, required=True)
@pass_options
def remove_volumes(opts: Options, names: tuple[str, ...]) -> None:
    """Delete volumes with their contents (refused while mounted); stops at the first failure."""
    _remove_each(opts, names, lambda client, name: client.volumes.delete(name))
