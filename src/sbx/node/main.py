"""``sandboxd``: the node server's command line.

Precedence for every option: the flag, then its ``SANDBOX_*`` environment variable, then the default.
Limits and network policy come from the ``--config`` TOML file (docs/config.md).
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import click

from sbx.backends.base import BackendError
from sbx.net.loopback import is_loopback
from sbx.node.config import ConfigError, load_config
from sbx.node.server import ServerOptions, StateDirLocked, serve
from sbx.web.logs import setup_logging
from sbx.web.serve import parse_host_port as serve_address

DEFAULT_SOCKET = Path("/run/sandboxd.sock")
DEFAULT_STATE_DIR = Path("/var/lib/sandboxd/state")
NODE_ID_PATTERN = re.compile(r"^[a-z0-9]{1,16}$")


def parse_host_port(value: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``; raises click.BadParameter naming the flag."""
    try:
        return serve_address(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=flag) from None


def read_token(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace removed); must not be empty."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint="--token-file") from None
    if not token:
        raise click.BadParameter(f"{path} is empty: put a token in it", param_hint="--token-file")
    return token


@click.command(context_settings={"auto_envvar_prefix": "SANDBOX", "help_option_names": ["-h", "--help"]})
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(path_type=Path),
    default=None,
    help=f"Unix socket to serve on (mode 0600). Default {DEFAULT_SOCKET} unless --listen is given.",
)
@click.option(
    "--listen",
    default=None,
    help="HOST:PORT to serve on over TCP; needs --token-file, and TLS unless HOST is loopback.",
)
@click.option(
    "--token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="File holding the bearer token clients must send (optional on a unix socket).",
)
@click.option("--tls-cert", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None)
@click.option("--tls-key", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=DEFAULT_STATE_DIR,
    show_default=True,
    help="Where sandboxd keeps its state; restarts take back its sandboxes.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    default=None,
    help="TOML config: limits, defaults, network policy, capacity (docs/config.md).",
)
@click.option("--node-id", default=None, help="Node id (1-16 of a-z 0-9): sandbox ids become sbx_<N>_<hex>.")
@click.option(
    "--metrics-listen", default=None, help="127.0.0.1:PORT for Prometheus /metrics (loopback only)."
)
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def main(
    socket_path: Path | None,
    listen: str | None,
    token_file: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    state_dir: Path,
    config_path: Path | None,
    node_id: str | None,
    metrics_listen: str | None,
    log_level: str,
) -> None:
    """Run sandboxd, the node server of the sandbox service."""
    listen_addr = parse_host_port(listen, "--listen") if listen else None
    if listen_addr is not None:
        if token_file is None:
            raise click.UsageError(
                "sandboxd refuses to listen on TCP without a token (loopback included): pass --token-file FILE"
            )
        if not is_loopback(listen_addr[0]) and (tls_cert is None or tls_key is None):
            raise click.UsageError(
                f"sandboxd refuses to listen on {listen_addr[0]}, reachable from other machines, without TLS: "
                "pass --tls-cert and --tls-key, or listen on 127.0.0.1"
            )
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    if (tls_cert is not None) and listen_addr is None:
        raise click.UsageError("--tls-cert and --tls-key apply to --listen; a unix socket needs no TLS")
    metrics_addr = parse_host_port(metrics_listen, "--metrics-listen") if metrics_listen else None
    if metrics_addr is not None and not is_loopback(metrics_addr[0]):
        raise click.UsageError(
            f"--metrics-listen must be a loopback address (127.0.0.1:PORT), not {metrics_addr[0]}: "
            "metrics take no credential"
        )
    if node_id is not None and not NODE_ID_PATTERN.match(node_id):
        raise click.BadParameter(f"{node_id!r} must be 1-16 of a-z and 0-9", param_hint="--node-id")
    if socket_path is None and listen_addr is None:
        socket_path = DEFAULT_SOCKET
    token = read_token(token_file) if token_file is not None else None
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None

    setup_logging(log_level)
    options = ServerOptions(
        state_dir=state_dir.resolve(),
        socket_path=socket_path,
        listen=listen_addr,
        token=token,
        tls_cert=tls_cert,
        tls_key=tls_key,
        node_id=node_id,
        metrics_listen=metrics_addr,
    )
    try:
        asyncio.run(serve(config, options))
    except (StateDirLocked, BackendError) as exc:
        click.echo(f"sandboxd: {exc}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
