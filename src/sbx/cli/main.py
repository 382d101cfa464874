"""``sandbox-cli``: the command line of the sandbox service, over the async SDK.

One module per command group: ``sandboxes`` (create, ls, get, rm), ``processes`` (run, exec),
``shell``, ``ssh`` (through a gateway's SSH server), ``files`` (cp), ``forward``, ``node`` (node, capabilities,
events), ``images``, ``ports`` (a sandbox's ports on URLs of their own, through a gateway), ``state`` (suspend,
resume, stop, snapshot, snapshots, volumes), ``gateway``, ``mcp`` (an MCP server over the SDK, ``sbx.mcp``).

Output: aligned tables or ``key: value`` lines for people, the server's JSON with ``--json``.
Errors are printed as ``code: message`` on stderr. Exit status: 0 on success, 1 for a failed
request (including an unreachable server), 2 for bad usage; ``run``, ``exec``, ``shell`` and ``ssh``
exit with the command's own status.
"""

from __future__ import annotations

import sys

import click

from sbx.api.errors import InvalidRequest
from sbx.cli import (
    files,
    forward,
    gateway,
    images,
    mcp,
    network,
    node,
    ports,
    processes,
    sandboxes,
    shell,
    ssh,
    state,
    workloads,
)
from sbx.cli._common import Options
from sbx.client import resolve_endpoint


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
    """Create sandboxes, run commands and open shells in them, copy files and forward ports."""
    try:
        endpoint = resolve_endpoint(url, token)
    except InvalidRequest as exc:
        raise click.BadParameter(exc.message, param_hint="'--url' / SANDBOX_URL") from None
    ctx.obj = Options(endpoint, as_json)


for command in (
    sandboxes.create,
    sandboxes.list_sandboxes,
    sandboxes.get,
    sandboxes.rm,
    processes.run,
    processes.exec_,
    shell.shell,
    ssh.ssh,
    files.cp,
    forward.forward,
    node.events,
    node.node,
    node.capabilities,
    images.images,
    state.suspend,
    state.resume,
    state.stop,
    state.snapshot,
    state.snapshots,
    state.volumes,
    network.network,
    ports.ports,
    gateway.gateway,
    workloads.services,
    workloads.jobs,
    workloads.secrets,
    mcp.mcp,
):
    main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
