"""``cp``: copy one file into or out of a sandbox (``REF:/path`` names the sandbox side)."""

from __future__ import annotations

import os
import posixpath
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from sbx.cli._common import Options, call, pass_options, print_json
from sbx.client import AsyncClient

#: ``REF:/absolute/path``: a ref has no ``/`` or ``:``, the guest path is absolute.
_REMOTE = re.compile(r"^(?P<ref>[^/:]+):(?P<path>/.*)$")


@dataclass(frozen=True)
class Remote:
    """The sandbox side of a copy."""

    ref: str
    path: str


def parse_location(text: str) -> Remote | str:
    """``Remote`` for ``REF:/path``, else the local path (``-`` is stdin or stdout)."""
    found = _REMOTE.match(text)
    return Remote(found["ref"], found["path"]) if found else text


@click.command()
@click.argument("source")
@click.argument("destination")
@pass_options
def cp(opts: Options, source: str, destination: str) -> None:
    """Copy a file between here and a sandbox, either way:

    \b
      sandbox-cli cp ./local.txt REF:/sandbox/home/local.txt
      sandbox-cli cp REF:/sandbox/home/out.bin ./out.bin
      sandbox-cli cp - REF:/sandbox/home/from-stdin      (and REF:/path - to stdout)

    A destination ending in / (or an existing local directory) receives the file under its own
    name. Files only (at most 64 MiB into a sandbox); parent directories in the sandbox are made.
    """
    src, dst = parse_location(source), parse_location(destination)
    if isinstance(src, Remote) == isinstance(dst, Remote):
        raise click.UsageError(
            "exactly one side of cp is in a sandbox, written REF:/absolute/path "
            f"(got {source!r} and {destination!r})"
        )
    if isinstance(dst, Remote):
        assert isinstance(src, str)
        _upload(opts, src, dst)
    else:
        assert isinstance(src, Remote)
        _download(opts, src, dst)


def _upload(opts: Options, local: str, remote: Remote) -> None:
    if local == "-":
        data = sys.stdin.buffer.read()
        name = "stdin"
    else:
        path = Path(local)
        if path.is_dir():
            raise click.UsageError(f"{local} is a directory; cp copies single files")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise click.FileError(local, exc.strerror) from None
        name = path.name
    target = remote.path + name if remote.path.endswith("/") else remote.path

    async def go(client: AsyncClient) -> None:
        sandbox = await client.sandboxes.get(remote.ref)
        await sandbox.files.write(target, data)

    call(opts, go)
    _report(opts, local, f"{remote.ref}:{target}", len(data))


def _download(opts: Options, remote: Remote, local: str) -> None:
    async def go(client: AsyncClient) -> bytes:
        sandbox = await client.sandboxes.get(remote.ref)
        return await sandbox.files.read(remote.path)

    data = call(opts, go)
    if local == "-":
        out = sys.stdout.buffer
        out.write(data)
        out.flush()
        return
    target = Path(local)
    if local.endswith(os.sep) or target.is_dir():
        target = target / posixpath.basename(remote.path.rstrip("/"))
    try:
        # Written beside the target and renamed: an interrupted copy never leaves half a file.
        partial = target.with_name(f".{target.name}.sandbox-cli-partial")
        partial.write_bytes(data)
        partial.replace(target)
    except OSError as exc:
        raise click.FileError(str(target), exc.strerror) from None
    _report(opts, f"{remote.ref}:{remote.path}", str(target), len(data))


def _report(opts: Options, source: str, destination: str, size: int) -> None:
    if opts.as_json:
        print_json({"source": source, "destination": destination, "bytes": size})
    else:
        click.echo(f"{source} -> {destination} ({size} bytes)", err=True)
