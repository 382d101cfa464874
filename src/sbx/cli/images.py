"""``images ls|pull|rm``: the server's image store (capability ``images``)."""

from __future__ import annotations

import asyncio
import sys

import click

from sbx.api.codec import to_builtins
from sbx.api.errors import Internal, NotFound, Unsupported
from sbx.api.images import Image, ImageRemoved
from sbx.cli._common import Options, call, cell, pass_options, print_json, print_table
from sbx.client import AsyncClient

#: Seconds between polls of an install in progress.
POLL_INTERVAL_SECS = 0.5
LIST_COLUMNS = ("image", "state", "digest", "bytes", "in_use", "installed_at")


async def _require_images(client: AsyncClient) -> None:
    """``Unsupported`` unless the server manages images; before any image call, so that a server
    without the endpoints gets one clear message rather than its 404 or 501."""
    caps = await client.capabilities()
    if not caps.capabilities.get("images"):
        raise Unsupported(
            "images are not supported by this server (capability 'images' is off): "
            "use the images installed on it, listed by `sandbox-cli node`"
        )


@click.group()
def images() -> None:
    """List, install and remove images on the server."""


@images.command(name="ls")
@pass_options
def list_images(opts: Options) -> None:
    """List the server's images."""

    async def go(client: AsyncClient) -> list[Image]:
        await _require_images(client)
        return await client.images.list()

    found = call(opts, go)
    if opts.as_json:
        print_json({"images": found})
    else:
        rows = [to_builtins(i) for i in found]
        print_table(LIST_COLUMNS, [[cell(i.get(c)) for c in LIST_COLUMNS] for i in rows])


@images.command()
@click.argument("image")
@click.option("--no-wait", is_flag=True, help="Return once the install has started.")
@pass_options
def pull(opts: Options, image: str, no_wait: bool) -> None:
    """Install IMAGE on the server (pull, and build its root disk), showing progress."""

    async def go(client: AsyncClient) -> Image:
        await _require_images(client)
        state = await client.images.pull(image)
        if no_wait:
            return state
        with click.progressbar(length=1, label=f"pulling {image}", file=sys.stderr) as bar:
            while state.state == "installing":
                progress = state.progress
                if progress and progress.total:
                    bar.length = progress.total
                    bar.update(progress.done - bar.pos)
                await asyncio.sleep(POLL_INTERVAL_SECS)
                listed = [i for i in await client.images.list() if i.image == state.image]
                if not listed:
                    raise NotFound(f"image {image!r} vanished from the server's list while installing")
                state = listed[0]
        if state.state == "failed":
            raise Internal(f"installing {image} failed: {state.error or 'no reason given'}")
        return state

    state = call(opts, go)
    if opts.as_json:
        print_json(state)
    else:
        click.echo(f"{image}: {state.state}")


@images.command()
@click.argument("image")
@pass_options
def rm(opts: Options, image: str) -> None:
    """Remove IMAGE from the server (not the default, a pooled or an in-use one)."""

    async def go(client: AsyncClient) -> ImageRemoved:
        await _require_images(client)
        return await client.images.remove(image)

    result = call(opts, go)
    if opts.as_json:
        print_json(result)
    else:
        click.echo(f"{image}: removed ({result.freed_bytes} bytes freed)")
