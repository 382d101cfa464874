"""``create``, ``ls``, ``get``, ``rm``: the sandbox resource (``stop`` and ``resume`` are in ``state``)."""

from __future__ import annotations

from typing import Any

import click

from sbx.api.codec import to_builtins
from sbx.api.node import PERSISTENT
from sbx.cli._common import (
    Options,
    call,
    cell,
    pairs,
    pass_options,
    print_fields,
    print_json,
    print_table,
    require_capability,
    state_text,
)
from sbx.cli.network import MODES, policy_options
from sbx.client import AsyncClient, Sandbox

LIST_COLUMNS = ("id", "name", "state", "persistent", "image", "cpus", "memory_mb", "disk_mb", "created_at")


@click.command()
@click.option("--name", help="Unique among live sandboxes.")
@click.option("--image", help="Image reference. Default: the server's default image.")
@click.option("--cpus", type=click.IntRange(min=1), help="vCPUs. Default: the server's.")
@click.option("--memory-mb", type=click.IntRange(min=1), help="Memory in MiB. Default: the server's.")
@click.option("--disk-mb", type=click.IntRange(min=1), help="Disk in MiB. Default: the server's.")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="Label; repeatable.")
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE", help="Environment variable; repeatable.")
@click.option(
    "--idle-timeout",
    "idle_timeout_secs",
    type=click.IntRange(min=0),
    help="Seconds without activity before it is terminated (suspended if --persistent). Default: the server's.",
)
@click.option(
    "--persistent",
    is_flag=True,
    help="Suspend it when idle instead of terminating it; `stop` frees its memory keeping its disk, and the "
    "next command that needs it wakes it. Needs --name.",
)
@click.option("--from-snapshot", "snapshot_id", metavar="ID", help="Fork this snapshot (see `snapshots ls`).")
@click.option(
    "--volume", "volumes", multiple=True, metavar="NAME:PATH[:ro]", help="Mount a volume; repeatable."
)
@click.option("--network", "network_mode", type=click.Choice(MODES), help="none, allowlist or open.")
@click.option("--allow", "allow", multiple=True, metavar="NAME", help="Allowed name or *.domain; repeatable.")
@click.option("--deny", "deny", multiple=True, metavar="NAME", help="Denied name or *.domain; repeatable.")
@pass_options
def create(
    opts: Options,
    name: str | None,
    image: str | None,
    cpus: int | None,
    memory_mb: int | None,
    disk_mb: int | None,
    labels: tuple[str, ...],
    env: tuple[str, ...],
    idle_timeout_secs: int | None,
    snapshot_id: str | None,
    volumes: tuple[str, ...],
    network_mode: str | None,
    allow: tuple[str, ...],
    deny: tuple[str, ...],
    persistent: bool,
) -> None:
    """Create a sandbox and print its id."""
    if persistent and not name:
        # The server refuses it too; saying so here names the option and sends nothing.
        raise click.UsageError(
            "--persistent needs --name: a persistent sandbox is found again by its name after it sleeps"
        )
    given = {
        "name": name,
        "image": image,
        "cpus": cpus,
        "memory_mb": memory_mb,
        "disk_mb": disk_mb,
        "idle_timeout_secs": idle_timeout_secs,
        "snapshot_id": snapshot_id,
    }
    fields: dict[str, Any] = {key: value for key, value in given.items() if value is not None}
    if labels:
        fields["labels"] = pairs(labels, "--label")
    if env:
        fields["env"] = pairs(env, "--env")
    if volumes:
        fields["volumes"] = [mount_entry(v) for v in volumes]
    network = policy_options(network_mode, allow, deny)
    if network is not None:
        fields["network"] = network
    if persistent:
        fields["persistent"] = True

    async def go(client: AsyncClient) -> Sandbox:
        if persistent:
            await require_capability(
                client,
                PERSISTENT,
                "persistent sandboxes",
                "create it without --persistent, or upgrade sandboxd",
            )
        return await client.sandboxes.create(**fields)

    sandbox = call(opts, go)
    if opts.as_json:
        print_json(sandbox.info)
    else:
        click.echo(sandbox.id)


def mount_entry(value: str) -> dict[str, Any]:
    """``NAME:PATH`` or ``NAME:PATH:ro`` as a create request's mount entry; bad usage otherwise."""
    parts = value.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1] or (len(parts) == 3 and parts[2] != "ro"):
        raise click.BadParameter(f"{value!r} is not NAME:PATH or NAME:PATH:ro", param_hint="'--volume'")
    entry: dict[str, Any] = {"name": parts[0], "path": parts[1]}
    if len(parts) == 3:
        entry["read_only"] = True
    return entry


@click.command(name="ls")
@click.option(
    "--label", "labels", multiple=True, metavar="KEY=VALUE", help="Only with this label; repeatable."
)
@click.option("-q", "--quiet", is_flag=True, help="Print ids only.")
@pass_options
def list_sandboxes(opts: Options, labels: tuple[str, ...], quiet: bool) -> None:
    """List sandboxes, newest first (terminated ones until the server forgets them).

    STATE says why a stopped persistent sandbox stopped, e.g. ``stopped (crash)``.
    """
    wanted = pairs(labels, "--label")
    sandboxes = call(opts, lambda client: client.sandboxes.list(labels=wanted))
    if opts.as_json:
        print_json({"sandboxes": [s.info for s in sandboxes]})
    elif quiet:
        for sandbox in sandboxes:
            click.echo(sandbox.id)
    else:
        rows = [{**to_builtins(s.info), "state": state_text(s.info)} for s in sandboxes]
        print_table(LIST_COLUMNS, [[cell(r.get(c)) for c in LIST_COLUMNS] for r in rows])


@click.command()
@click.argument("ref")
@pass_options
def get(opts: Options, ref: str) -> None:
    """Show one sandbox (REF is an id or a name)."""
    sandbox = call(opts, lambda client: client.sandboxes.get(ref))
    if opts.as_json:
        print_json(sandbox.info)
    else:
        print_fields(sandbox.info)


@click.command()
@click.argument("refs", metavar="REF...", nargs=-1, required=True)
@pass_options
def rm(opts: Options, refs: tuple[str, ...]) -> None:
    """Terminate sandboxes (REF is an id or a name); terminating one twice is fine.

    Prints each REF as it is removed; stops at the first failure.
    """

    async def remove(client: AsyncClient) -> None:
        for ref in refs:
            await client.sandboxes.delete(ref)
            if not opts.as_json:
                click.echo(ref)

    call(opts, remove)
