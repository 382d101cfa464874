"""``network REF``: show a sandbox's network policy, or change it live (``--mode``, ``--allow``, ``--deny``;
PATCH, capability ``network_policy_update``; see docs/network.md). Also the create options' shared parsing."""

from __future__ import annotations

from typing import Any

import click

from sbx.api.codec import to_builtins
from sbx.cli._common import Options, call, pass_options, print_fields, print_json
from sbx.client import AsyncClient

MODES = ("none", "allowlist", "open")


def policy_options(mode: str | None, allow: tuple[str, ...], deny: tuple[str, ...]) -> dict[str, Any] | None:
    """The request's ``network`` object from the command line; None when nothing was given (the server's
    default then applies). ``--allow``/``--deny`` are sent as given: the server normalises and checks them."""
    if mode is None and not allow and not deny:
        return None
    policy: dict[str, Any] = {}
    if mode is not None:
        policy["mode"] = mode
    if allow:
        policy["allow"] = list(allow)
    if deny:
        policy["deny"] = list(deny)
    return policy


def _shown(policy: dict[str, Any]) -> dict[str, Any]:
    return {
        "mode": policy.get("mode"),
        "allow": ", ".join(policy.get("allow") or []) or "-",
        "deny": ", ".join(policy.get("deny") or []) or "-",
    }


@click.command()
@click.argument("ref")
@click.option("--mode", type=click.Choice(MODES), help="none, allowlist or open; required to change it.")
@click.option("--allow", "allow", multiple=True, metavar="NAME", help="Allowed name or *.domain; repeatable.")
@click.option("--deny", "deny", multiple=True, metavar="NAME", help="Denied name or *.domain; repeatable.")
@pass_options
def network(opts: Options, ref: str, mode: str | None, allow: tuple[str, ...], deny: tuple[str, ...]) -> None:
    """Show the network policy of REF, or replace it at once with --mode (and --allow/--deny).

    Connections the new policy does not permit are cut. A sandbox created with mode none has no network
    interface and cannot be widened.
    """
    if mode is None and (allow or deny):
        raise click.UsageError("--allow and --deny replace the whole policy: give --mode as well")
    policy = policy_options(mode, allow, deny)

    async def go(client: AsyncClient) -> dict[str, Any]:
        sandbox = await client.sandboxes.get(ref)
        if policy is not None:
            await sandbox.update(network=policy)
        network_info: dict[str, Any] = to_builtins(sandbox.info.network)
        return network_info

    shown = call(opts, go)
    if opts.as_json:
        print_json(shown)
    else:
        print_fields(_shown(shown))
