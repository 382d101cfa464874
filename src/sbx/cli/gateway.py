"""``sandbox-cli gateway``: fleet operation through a gateway's admin API (an admin key in SANDBOX_TOKEN).

``nodes`` (health, cordon, sandboxes running, version), ``cordon``/``uncordon``, ``drain [--terminate]``,
``lost`` and ``audit --since``. No command here issues or revokes API keys (spec: Fleet operation tools).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import click

from sbx.cli._common import Options, call, cell, pass_options, print_json, print_table

_DURATION = re.compile(r"^(\d+)(s|m|h|d)$")


def since_time(value: str) -> str:
    """``30m``, ``2h``, ``1d`` ago (or an RFC 3339 time as given) as the RFC 3339 ``since`` of the audit call."""
    match = _DURATION.match(value)
    if match is None:
        try:
            datetime.fromisoformat(value)
        except ValueError:
            raise click.BadParameter(
                f"{value!r} is not a duration like 30m, 2h, 1d or an RFC 3339 time"
            ) from None
        return value
    secs = int(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    when = datetime.now(UTC) - timedelta(seconds=secs)
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


@click.group()
def gateway() -> None:
    """Operate a gateway's fleet (needs an admin key)."""


@gateway.command("nodes")
@pass_options
def nodes(opts: Options) -> None:
    """Nodes: health, cordon, sandboxes running, node version."""
    listed = call(opts, lambda c: c.admin.nodes())
    if opts.as_json:
        print_json({"nodes": listed})
        return
    rows = []
    for n in listed:
        status = n.status or None
        health = "lost" if n.lost else "up" if n.healthy else "down"
        rows.append([n.name, health, "yes" if n.cordoned else "no", cell(status.running if status else None),
                     cell(status.version if status else None), n.endpoint, cell(n.error or None)])  # fmt: skip
    print_table(["name", "health", "cordoned", "running", "version", "endpoint", "error"], rows)


def _cordon(opts: Options, node: str, cordoned: bool) -> None:
    answer = call(opts, lambda c: c.admin.cordon(node, cordoned))
    if opts.as_json:
        print_json(answer)
    else:
        click.echo(f"{node}: {'cordoned' if cordoned else 'uncordoned'}")


@gateway.command()
@click.argument("node")
@pass_options
def cordon(opts: Options, node: str) -> None:
    """Stop placing new sandboxes on NODE (running ones carry on)."""
    _cordon(opts, node, True)


@gateway.command()
@click.argument("node")
@pass_options
def uncordon(opts: Options, node: str) -> None:
    """Place new sandboxes on NODE again (also ends a drain)."""
    _cordon(opts, node, False)


@gateway.command()
@click.argument("node")
@click.option("--terminate", is_flag=True, help="Terminate the sandboxes still running there.")
@pass_options
def drain(opts: Options, node: str, terminate: bool) -> None:
    """Cordon NODE (kept across its restarts) and say how many sandboxes still run; run again until 0."""
    answer = call(opts, lambda c: c.admin.drain(node, terminate))
    if opts.as_json:
        print_json(answer)
        return
    click.echo(f"{node}: cordoned; {answer.remaining} sandboxes still running")
    if answer.terminated:
        click.echo(f"terminated: {len(answer.terminated)}")
    if answer.suspended:
        click.echo(f"persistent sandboxes suspended: {len(answer.suspended)}")
    for failure in answer.failed or []:
        what = "terminate" if terminate else "suspend"
        click.echo(f"failed to {what} {failure.id}: {failure.error}", err=True)


@gateway.command()
@pass_options
def lost(opts: Options) -> None:
    """Sandboxes on nodes down longer than the gateway's --node-lost-after."""
    answer = call(opts, lambda c: c.admin.lost())
    if opts.as_json:
        print_json({"sandboxes": answer})
        return
    rows = [[s.id, s.user, cell(s.tenant), s.node, cell(s.node_down_since)] for s in answer]
    print_table(["id", "user", "tenant", "node", "node down since"], rows)


@gateway.command()
@click.option(
    "--since", default="1h", show_default=True, help="How far back: 30m, 2h, 1d, or an RFC 3339 time."
)
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 1000))
@pass_options
def audit(opts: Options, since: str, limit: int) -> None:
    """The gateway's audit log, oldest first."""
    answer = call(opts, lambda c: c.admin.audit(since_time(since), limit))
    if opts.as_json:
        print_json(answer)
        return
    rows = [[e.get("time", ""), e.get("type", ""), cell(e.get("user")), cell(e.get("key_id")),
             " ".join(x for x in (e.get("method", ""), e.get("route", "")) if x), cell(e.get("status")),
             cell(e.get("target")), cell(e.get("result"))] for e in answer.entries]  # fmt: skip
    print_table(["time", "type", "user", "key", "route", "status", "target", "result"], rows)
    if answer.truncated:
        click.echo("(more entries follow; raise --limit or narrow --since)", err=True)
