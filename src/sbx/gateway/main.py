"""``sandbox-gateway``: serve the gateway, change its state offline (keys, nodes, quotas), or move a SQLite state
into PostgreSQL (``migrate``).

The state is a SQLite file (``--state FILE``) or a PostgreSQL database (``--database URL``; docs/ha.md). Offline
commands take the store's owner lock and refuse while a gateway serves it: a change made beside a running gateway
would be overwritten by it (a revoked key would come back). The first admin key of a fresh install is made with
``sandbox-gateway keys create --state FILE --user admin --scope admin``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import signal
import ssl
import sys
import tomllib
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from aiohttp import web

from sbx.api.codec import convert_request, to_builtins
from sbx.api.errors import SandboxError
from sbx.api.gateway import NodeAddRequest
from sbx.gateway import keys as keymod
from sbx.gateway.audit import AuditLog, GatewayAudit, StoreAudit
from sbx.gateway.jobs.agents import AgentsFileError, load_agents
from sbx.gateway.jobs.controller import JobOptions
from sbx.gateway.jobs.notify import NotifyPolicy
from sbx.gateway.middlewares import install_cors, make_middlewares
from sbx.gateway.nodes import (
    DEFAULT_FAILURES_UNHEALTHY,
    DEFAULT_FORGET_INTERVAL_SECS,
    DEFAULT_POLL_INTERVAL_SECS,
    Registry,
)
from sbx.gateway.ports.front import DEFAULT_MAX_PER_SANDBOX as DEFAULT_MAX_PUBLIC_PER_SANDBOX
from sbx.gateway.revocation import DEFAULT_RECHECK_SECS
from sbx.gateway.routes import install
from sbx.gateway.routes.admin import node_def_from
from sbx.gateway.secrets import SecretBox, SecretsKeyError, check_key, load_key, new_key_file
from sbx.gateway.server import Gateway, GatewayOptions
from sbx.gateway.services.public import DEFAULT_MAX_PER_SERVICE as DEFAULT_MAX_PUBLIC_PER_SERVICE
from sbx.gateway.services.public import DEFAULT_MAX_TOTAL as DEFAULT_MAX_PUBLIC
from sbx.gateway.ssh.hostkeys import HostKeyError, HostKeys, load_or_create, load_shared
from sbx.gateway.ssh.server import SshOptions, SshServer
from sbx.gateway.ssh.throttle import DEFAULT_MAX_AUTH_TRIES, DEFAULT_SOURCE_FAILURES, LoginLimits
from sbx.gateway.state import NodeDef, Quota, StateError, StateLocked
from sbx.gateway.store import TABLES, Store, StoreLocation, check_database_url, copy_state, open_store
from sbx.net.limits import raise_descriptor_limit
from sbx.net.loopback import is_loopback
from sbx.web.connections import IDLE_TIMEOUT_SECS, MAX_UNAUTHENTICATED
from sbx.web.console import Console
from sbx.web.http import JSON_BODY_CAP
from sbx.web.logs import setup_logging
from sbx.web.serve import Listen, metrics_server, run, server_tls
from sbx.web.serve import parse_host_port as serve_address

DEFAULT_LISTEN = "127.0.0.1:7443"
log = logging.getLogger("sbx.gateway")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")
#: One label of a DNS name (``--ports-domain``).
_DNS_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


def parse_duration(value: str, flag: str) -> float:
    """``300``, ``30s``, ``5m``, ``1h``, ``7d``, ``500ms`` as seconds."""
    match = _DURATION.match(value.strip())
    if not match:
        raise click.BadParameter(f"{value!r} is not a duration like 30s, 5m or 1h", param_hint=flag)
    number = float(match.group(1))
    return number * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}[match.group(2)]


def load_node_file(path: Path) -> list[NodeDef]:
    """Nodes of a TOML node file: ``[[node]]`` tables with ``name``, ``endpoint`` and optional ``token_file``,
    ``ca_file``, ``cert_file``, ``key_file`` (relative paths are relative to the node file)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise click.BadParameter(f"cannot read {path}: {exc}", param_hint="--node-file") from None
    entries = data.get("node", [])
    if not isinstance(entries, list):
        raise click.BadParameter(f"{path}: write each node as a [[node]] table", param_hint="--node-file")
    found: list[NodeDef] = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise click.BadParameter(f"{path}: each [[node]] must be a table", param_hint="--node-file")
        body = dict(entry)
        for name in ("token_file", "ca_file", "cert_file", "key_file"):
            if isinstance(body.get(name), str):
                body[name] = str((path.parent / body[name]).resolve())
        try:
            definition = node_def_from(convert_request(body, NodeAddRequest), Path("/"))
        except SandboxError as exc:
            raise click.BadParameter(f"{path}: {exc.message}", param_hint="--node-file") from None
        found.append(NodeDef(**{**definition.__dict__, "from_file": True}))
    names = [d.name for d in found]
    if len(set(names)) != len(names):
        raise click.BadParameter(f"{path}: a node name appears twice", param_hint="--node-file")
    return found


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """The sandbox gateway: one API in front of many sandboxd nodes."""


def location_of(state_path: Path | None, database: str | None) -> StoreLocation:
    """The store named by ``--state`` or ``--database`` (exactly one; a database URL without a password)."""
    if (state_path is None) == (database is None):
        both = ", not both" if state_path is not None else ""
        raise click.UsageError(
            "give the gateway's state: --state FILE (SQLite, one machine) or --database postgresql://USER@HOST/DB "
            f"(PostgreSQL; docs/ha.md){both}"
        )
    if database is not None:
        try:
            check_database_url(database)
        except StateError as exc:
            raise click.BadParameter(str(exc), param_hint="--database") from None
    return StoreLocation(state=state_path, database=database)


def state_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--state FILE`` / ``--database URL``, given to the command as ``location``."""

    @click.option(
        "--database", default=None, envvar="SANDBOX_GATEWAY_DATABASE",
        help="PostgreSQL URL, postgresql://USER@HOST[:PORT]/DB (no password in it: set "
             "SANDBOX_GATEWAY_DATABASE_PASSWORD or use PGPASSFILE); instead of --state.",
    )  # fmt: skip
    @click.option(
        "--state", "state_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
        envvar="SANDBOX_GATEWAY_STATE", help="The gateway's SQLite state file (or --database).",
    )  # fmt: skip
    @functools.wraps(fn)
    def wrapper(state_path: Path | None, database: str | None, **kwargs: Any) -> Any:
        return fn(location=location_of(state_path, database), **kwargs)

    return wrapper


@contextmanager
def offline_store(location: StoreLocation) -> Iterator[Store]:
    """The store, locked, for an offline change; refuses clearly while a gateway serves it."""
    try:
        store = open_store(location)
    except (StateLocked, StateError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        yield store
    finally:
        store.close()


@main.command()
@state_option
@click.option("--listen", default=DEFAULT_LISTEN, show_default=True,
              help="HOST:PORT, or unix:/PATH for a unix socket (mode 0600).")  # fmt: skip
@click.option("--tls-cert", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None)
@click.option("--tls-key", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None)
@click.option("--node-file", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="TOML file of [[node]] tables; such nodes change only by editing it and restarting.")  # fmt: skip
@click.option("--node-files-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="The only directory whose token/CA/cert files nodes added through the admin API may name.")  # fmt: skip
@click.option("--node-lost-after", default="5m", show_default=True, help="Down this long, a node is lost.")
@click.option("--audit-log", default=None,
              help="Audit log file, or 'none'. Default: audit/gateway.jsonl beside the state file.")  # fmt: skip
@click.option(
    "--cors-origin", multiple=True, help="An Origin allowed besides the gateway's own (repeatable)."
)
@click.option(
    "--metrics-listen", default=None, help="127.0.0.1:PORT for Prometheus /metrics (loopback only)."
)
@click.option("--ssh-listen", default=None,
              help="HOST:PORT for SSH into sandboxes (docs/ssh.md); without it the SSH endpoints answer 404.")  # fmt: skip
@click.option("--ssh-advertise", default=None,
              help="HOST:PORT clients reach the SSH server at, when not the --ssh-listen address.")  # fmt: skip
@click.option("--ssh-max-auth-tries", default=DEFAULT_MAX_AUTH_TRIES, show_default=True, type=click.IntRange(min=1),
              envvar="SANDBOX_GATEWAY_SSH_MAX_AUTH_TRIES",
              help="SSH keys and tokens one connection may try (OpenSSH's MaxAuthTries; docs/ssh.md).")  # fmt: skip
@click.option("--ssh-source-failures", default=DEFAULT_SOURCE_FAILURES, show_default=True,
              type=click.IntRange(min=1), envvar="SANDBOX_GATEWAY_SSH_SOURCE_FAILURES",
              help="Failed SSH logins from one address within --ssh-source-window before it is refused (answered "
                   "late from half of it).")  # fmt: skip
@click.option("--ssh-source-window", default="10m", show_default=True, envvar="SANDBOX_GATEWAY_SSH_SOURCE_WINDOW",
              help="How long a failed SSH login counts against its address.")  # fmt: skip
@click.option("--max-orgs-per-user", default=10, show_default=True, type=click.IntRange(min=0),
              help="Organisations a user may make or own.")  # fmt: skip
@click.option("--idle-timeout", default=str(IDLE_TIMEOUT_SECS), show_default=True,
              help="Close a connection with no whole request head this long after opening or its last answer.")  # fmt: skip
@click.option("--drain", default="0s", show_default=True, envvar="SANDBOX_GATEWAY_DRAIN",
              help="At SIGTERM, answer GET /v1/ready 503 and go on serving this long before stopping, so a load "
                   "balancer moves away first (docs/ha.md); SIGINT stops at once.")  # fmt: skip
@click.option("--max-unauthenticated", default=MAX_UNAUTHENTICATED, show_default=True, type=click.IntRange(min=1),
              help="TCP connections not yet authenticated kept at most (a new one closes the oldest).")  # fmt: skip
@click.option("--max-public-connections", default=DEFAULT_MAX_PUBLIC, show_default=True, type=click.IntRange(min=1),
              envvar="SANDBOX_GATEWAY_MAX_PUBLIC_CONNECTIONS",
              help="TCP connections without a key to public services kept at most, all together "
                   "(docs/services.md).")  # fmt: skip
@click.option("--max-public-connections-per-service", default=DEFAULT_MAX_PUBLIC_PER_SERVICE, show_default=True,
              type=click.IntRange(min=1), envvar="SANDBOX_GATEWAY_MAX_PUBLIC_CONNECTIONS_PER_SERVICE",
              help="TCP connections without a key to one public service kept at most.")  # fmt: skip
@click.option("--secrets-key-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="32 random bytes (raw or 64 hex characters) sealing tenant secrets; without it secrets are 501. "
                   "Make one with: sandbox-gateway secrets-key new FILE.")  # fmt: skip
@click.option("--agents-file", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="TOML file of [[agent]] tables for POST /v1/agent-runs (docs/jobs.md).")  # fmt: skip
@click.option("--notify-allow-private", is_flag=True,
              help="Let job notifications go to private and loopback addresses (and http to loopback).")  # fmt: skip
@click.option(
    "--no-notify", is_flag=True, help="Send no job notifications: a job naming notify is refused (501)."
)
@click.option(
    "--rollout-timeout", default="300", show_default=True, help="A service rollout fails after this long."
)
@click.option("--services-domain", default=None,
              help="Serve service traffic on <service>[--<tenant>].DOMAIN (wildcard DNS to the gateway); "
                   "/svc/<label>/ on the gateway's address always works.")  # fmt: skip
@click.option("--ports-domain", default=None,
              help="Serve each sandbox's TCP ports on <port>-<sandbox>.DOMAIN (wildcard DNS *.DOMAIN to the gateway; "
                   "it may carry a port: ports.example.com:8443); without it the ports endpoints are 501 "
                   "(docs/ports.md).")  # fmt: skip
@click.option("--max-public-connections-per-sandbox", default=DEFAULT_MAX_PUBLIC_PER_SANDBOX, show_default=True,
              type=click.IntRange(min=1), envvar="SANDBOX_GATEWAY_MAX_PUBLIC_CONNECTIONS_PER_SANDBOX",
              help="TCP connections without a key to one sandbox's public ports kept at most.")  # fmt: skip
@click.option("--jobs-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Where jobs' output and kept files are stored. Default: jobs/ beside the state file.")  # fmt: skip
@click.option("--job-retention", default="7d", show_default=True,
              help="Finished jobs (and their output) are forgotten after this long.")  # fmt: skip
@click.option("--console/--no-console", "serve_console", default=True, show_default=True,
              help="Serve the web console at /console/ (docs/console.md).")  # fmt: skip
@click.option("--poll-interval", default=str(DEFAULT_POLL_INTERVAL_SECS), hidden=True)
@click.option("--failures-unhealthy", default=DEFAULT_FAILURES_UNHEALTHY, type=int, hidden=True)
@click.option("--forget-interval", default=str(DEFAULT_FORGET_INTERVAL_SECS), hidden=True)
@click.option("--recheck-interval", default=str(DEFAULT_RECHECK_SECS), hidden=True)
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              envvar="SANDBOX_GATEWAY_DATA_DIR",
              help="This gateway's local files (audit log, jobs' output, SSH host keys). Default: the state file's "
                   "directory; required with --database.")  # fmt: skip
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def serve(
    location: StoreLocation, data_dir: Path | None, listen: str, tls_cert: Path | None, tls_key: Path | None,
    node_file: Path | None, node_files_dir: Path | None, node_lost_after: str, audit_log: str | None, cors_origin: tuple[str, ...],
    metrics_listen: str | None, ssh_listen: str | None, ssh_advertise: str | None, ssh_max_auth_tries: int,
    ssh_source_failures: int, ssh_source_window: str, max_orgs_per_user: int,
    idle_timeout: str, drain: str, max_unauthenticated: int, max_public_connections: int, max_public_connections_per_service: int,
    secrets_key_file: Path | None, agents_file: Path | None, notify_allow_private: bool, no_notify: bool,
    rollout_timeout: str, services_domain: str | None, ports_domain: str | None,
    max_public_connections_per_sandbox: int, jobs_dir: Path | None, job_retention: str,
    serve_console: bool, poll_interval: str, failures_unhealthy: int, forget_interval: str, recheck_interval: str,
    log_level: str,
) -> None:  # fmt: skip
    """Serve the gateway API until SIGTERM or SIGINT."""
    if location.state is not None:
        local = data_dir if data_dir is not None else location.state.parent
        host_key_base = location.state
    elif data_dir is None:
        raise click.UsageError(
            "with --database give --data-dir DIR too: where this gateway keeps its local files (audit log, jobs' "
            "output, SSH host keys)"
        )
    else:
        local = data_dir
        host_key_base = data_dir / "gateway"
    socket_path: Path | None = None
    listen_addr: tuple[str, int] | None = None
    if listen.startswith("unix:"):
        socket_path = Path(listen[len("unix:") :].removeprefix("//"))
    else:
        listen_addr = parse_host_port(listen, "--listen")
        if not is_loopback(listen_addr[0]) and (tls_cert is None or tls_key is None):
            raise click.UsageError(
                f"sandbox-gateway refuses to listen on {listen_addr[0]}, reachable from other machines, without "
                "TLS: pass --tls-cert and --tls-key, or listen on 127.0.0.1"
            )
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    metrics_addr = parse_host_port(metrics_listen, "--metrics-listen") if metrics_listen else None
    if metrics_addr is not None and not is_loopback(metrics_addr[0]):
        raise click.UsageError(f"--metrics-listen must be loopback (127.0.0.1:PORT), not {metrics_addr[0]}: "
                               "metrics take no credential")  # fmt: skip
    file_nodes = load_node_file(node_file) if node_file is not None else []
    ssh_options = None
    if ssh_listen is not None:
        advertised = parse_host_port(ssh_advertise, "--ssh-advertise") if ssh_advertise else None
        window = parse_duration(ssh_source_window, "--ssh-source-window")
        if window <= 0:
            raise click.BadParameter("give a duration over 0, such as 10m", param_hint="--ssh-source-window")
        login_limits = LoginLimits(ssh_max_auth_tries, ssh_source_failures, window)
        ssh_options = SshOptions(parse_host_port(ssh_listen, "--ssh-listen"), advertised, limits=login_limits)
    elif ssh_advertise is not None:
        raise click.UsageError("--ssh-advertise needs --ssh-listen")
    audit_path = (
        None if audit_log == "none" else Path(audit_log) if audit_log else local / "audit" / "gateway.jsonl"
    )
    # Replicas on one database share what a client may read through any of them (docs/ha.md): the audit log,
    # the jobs' kept output and files, and the SSH host keys live in the database.
    shared = location.database is not None
    if shared and audit_log not in (None, "none"):
        raise click.UsageError(
            "with --database the audit log is kept in the database, shared by the replicas: --audit-log takes "
            "only 'none' there"
        )
    if no_notify and notify_allow_private:
        raise click.UsageError("--no-notify and --notify-allow-private contradict each other: give one")
    try:
        secrets_key = load_key(secrets_key_file) if secrets_key_file is not None else None
        agents = load_agents(agents_file) if agents_file is not None else {}
    except (SecretsKeyError, AgentsFileError) as exc:
        raise click.UsageError(str(exc)) from None
    jobs = JobOptions(
        outputs_dir=jobs_dir if jobs_dir is not None else local / "jobs",
        retention_secs=parse_duration(job_retention, "--job-retention"),
        notify=NotifyPolicy(enabled=not no_notify, allow_private=notify_allow_private), agents=agents,
        shared_outputs=shared,
    )  # fmt: skip
    options = GatewayOptions(
        secrets_key=secrets_key,
        jobs=jobs,
        rollout_timeout_secs=parse_duration(rollout_timeout, "--rollout-timeout"),
        services_domain=services_domain,
        ports_domain=check_ports_domain(ports_domain, services_domain),
        max_public_connections_per_sandbox=max_public_connections_per_sandbox,
        max_public_connections=max_public_connections,
        max_public_connections_per_service=max_public_connections_per_service,
        cors_origins=frozenset(cors_origin),
        node_files_dir=node_files_dir,
        max_orgs_per_user=max_orgs_per_user,
        forget_interval_secs=parse_duration(forget_interval, "--forget-interval"),
        recheck_secs=parse_duration(recheck_interval, "--recheck-interval"),
        file_nodes=file_nodes,
    )
    lost_after = parse_duration(node_lost_after, "--node-lost-after")
    drain_secs = parse_duration(drain, "--drain")
    poll = parse_duration(poll_interval, "--poll-interval")
    setup_logging(log_level)
    try:
        store = open_store(location, serving=True)
    except (StateLocked, StateError) as exc:
        click.echo(f"sandbox-gateway: {exc}", err=True)
        sys.exit(1)
    box = SecretBox(secrets_key) if secrets_key is not None else None
    if box is not None:
        assert secrets_key_file is not None
        try:
            check_key(store, box, secrets_key_file)
        except SecretsKeyError as exc:
            store.close()
            click.echo(f"sandbox-gateway: {exc}", err=True)
            sys.exit(1)
    ssh = None
    if ssh_options is not None:
        try:
            ssh = (
                ssh_options,
                load_shared(store, host_key_base, box) if shared else load_or_create(host_key_base),
            )
        except HostKeyError as exc:
            store.close()
            click.echo(f"sandbox-gateway: {exc}", err=True)
            sys.exit(1)
    for definition in file_nodes:
        if definition.name in store.nodes:
            click.echo(f"sandbox-gateway: node {definition.name!r} is both in the node file and added through the "
                       "admin API; remove one (sandbox-gateway nodes remove)", err=True)  # fmt: skip
            sys.exit(1)
    registry = Registry(
        poll_interval_secs=poll, failures_unhealthy=failures_unhealthy, lost_after_secs=lost_after
    )
    audit: AuditLog | None = None
    if audit_path is not None:
        audit = StoreAudit(store) if shared else GatewayAudit(audit_path)
    gateway = Gateway(store, registry, audit, options)
    tls = server_tls(tls_cert, tls_key)
    # Connections hold descriptors, a proxied request two (the client's and the tunnel's): the caps above are
    # meant to be reached before the open-file limit, which systemd sets to 1024 unless raised.
    raise_descriptor_limit()
    lost: list[str] = []

    def owner_lost(reason: str) -> None:
        # The database let go of this gateway's owner lock (restarted, failed over, cut): another process may own
        # it now, so this one stops (exit 1: systemd's Restart=on-failure starts it again, reading the database).
        lost.append(reason)
        log.critical("lost the database's owner lock; stopping", extra={"error": reason})
        if len(lost) == 1:  # once: the owner and the leader connections are often lost together
            # SIGINT: at once, without the drain a SIGTERM gets (its memory may no longer match the database).
            os.kill(os.getpid(), signal.SIGINT)

    store.watch_owner(owner_lost)
    gateway.stop_process = owner_lost
    try:
        limits = ConnectionLimits(parse_duration(idle_timeout, "--idle-timeout"), max_unauthenticated)
        console = Console() if serve_console else None
        asyncio.run(
            _serve(gateway, socket_path, listen_addr, tls, metrics_addr, limits, ssh, console, drain_secs)
        )
    finally:
        store.close()
    if lost:
        click.echo(f"sandbox-gateway: stopped: the database let go of this gateway's owner lock ({lost[0]}); "
                   "start it again once the database is back", err=True)  # fmt: skip
        sys.exit(1)


def check_ports_domain(domain: str | None, services_domain: str | None) -> str | None:
    """``--ports-domain`` as given (None: not served), refused when it is no host name (an optional ``:PORT``
    after it) or is the services' domain (each wildcard name belongs to one front)."""
    if domain is None:
        return None
    name = domain.lower().strip(".")
    host, _, port = name.partition(":")
    labels = host.split(".")
    if not host or (port and not port.isdigit()) or not all(_DNS_LABEL.fullmatch(x) for x in labels):
        raise click.BadParameter(f"{domain!r} is no DNS name: give one such as ports.example.com, with :PORT if "
                                 "clients reach the gateway on another port", param_hint="--ports-domain")  # fmt: skip
    if services_domain is not None and host == services_domain.lower().strip(".").partition(":")[0]:
        raise click.BadParameter("it is also --services-domain: give each a wildcard name of its own",
                                 param_hint="--ports-domain")  # fmt: skip
    return name


def parse_host_port(value: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``; raises click.BadParameter naming the flag."""
    try:
        return serve_address(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=flag) from None


@dataclass(frozen=True)
class ConnectionLimits:
    """What a connection may do before it authenticates (see ``sbx.web.connections``)."""

    idle_timeout_secs: float
    max_unauthenticated: int


async def _serve(
    gateway: Gateway, socket_path: Path | None, listen: tuple[str, int] | None, tls: ssl.SSLContext | None,
    metrics_addr: tuple[str, int] | None, limits: ConnectionLimits, ssh: tuple[SshOptions, HostKeys] | None = None,
    console: Console | None = None, drain_secs: float = 0.0,
) -> None:  # fmt: skip
    app = build_app(gateway, metrics_addr, ssh, console)

    def draining() -> None:
        gateway.draining = True

    def ready() -> None:
        ssh_port = {"ssh_port": gateway.ssh.port} if gateway.ssh is not None else {}
        print(json.dumps({"msg": "sandbox-gateway serving", "nodes": sorted(gateway.registry.nodes), **ssh_port}),
              file=sys.stderr, flush=True)  # fmt: skip

    # A client that goes away cancels its handler, and with it the relay to the node: a followed output stream
    # of a quiet process would otherwise stay open until the process writes again.
    await run(
        app, Listen(socket_path, listen, tls), ready=ready, cancel_on_disconnect=True,
        idle_timeout_secs=limits.idle_timeout_secs, max_unauthenticated=limits.max_unauthenticated,
        drain_secs=drain_secs, draining=draining,
    )  # fmt: skip


def build_app(
    gateway: Gateway,
    metrics_addr: tuple[str, int] | None,
    ssh: tuple[SshOptions, HostKeys] | None = None,
    console: Console | None = None,
) -> web.Application:
    """The gateway's application: the gateway's loops, its workloads (services, jobs) and the audit log run
    while it serves, and the SSH server when ``ssh`` is given (started after the loops, stopped before them);
    at a stop, open relays (followed streams, attach, tunnel) are cut before the server waits for handlers to
    end. ``console``: the web console served at /console/ (None: not served)."""
    front = gateway.service_front
    ports = gateway.ports
    fronts = [front.middleware, *([ports.middleware] if ports is not None else [])]
    app = web.Application(middlewares=make_middlewares(gateway, *fronts), client_max_size=JSON_BODY_CAP)
    install_cors(app, gateway)
    install(app, gateway)
    if console is not None:
        app.add_routes(console.routes())

    async def run_gateway(app: web.Application) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.close()
        if gateway.audit is not None:
            gateway.audit.close()

    async def run_workloads(app: web.Application) -> AsyncIterator[None]:
        # After the gateway's loops (nodes polled once), before serving; stopped before them.
        # The work done once starts here on the leader (at once with SQLite; on PostgreSQL once this replica is
        # elected, which may be later: docs/ha.md).
        await gateway.lead()
        gateway.watchers += [gateway.services, front, gateway.jobs, *([ports] if ports is not None else [])]
        yield
        await gateway.jobs.close()
        await gateway.services.close()

    async def cut_open_relays(app: web.Application) -> None:
        gateway.open.cancel_all()
        await front.close()
        if ports is not None:
            await ports.close()

    app.cleanup_ctx.append(run_gateway)
    app.cleanup_ctx.append(run_workloads)
    if ssh is not None:
        app.cleanup_ctx.append(ssh_server(gateway, *ssh))
    app.on_shutdown.append(cut_open_relays)
    if metrics_addr is not None:
        app.cleanup_ctx.append(metrics_server(gateway.metrics, metrics_addr))
    return app


def ssh_server(
    gateway: Gateway, options: SshOptions, host_keys: HostKeys
) -> Callable[[web.Application], AsyncIterator[None]]:
    """The SSH server as a cleanup_ctx: listening while the application serves."""

    async def run_ssh(app: web.Application) -> AsyncIterator[None]:
        server = SshServer(
            host_keys, options, store=gateway.store, sandboxes=gateway.sandboxes, nodes=gateway, audit=gateway,
            metrics=gateway.metrics, watchers=gateway.watchers,
        )  # fmt: skip
        await server.start()
        gateway.ssh = server
        yield
        gateway.ssh = None
        await server.close()

    return run_ssh


# -- offline: keys ----------------------------------------------------------------------------------


@main.group()
def keys() -> None:
    """Issue, list and revoke API keys in the state file while the gateway is stopped."""


def _emit(as_json: bool, data: Any, text: Callable[[], None]) -> None:
    if as_json:
        click.echo(json.dumps(to_builtins(data), indent=2))
    else:
        text()


@keys.command("create")
@state_option
@click.option("--user", required=True)
@click.option("--tenant", default=None, help="Tenant of the key (default: the default tenant).")
@click.option("--scope", "scopes", multiple=True, required=True,
              type=click.Choice(sorted(keymod.SCOPES)), help="Repeatable.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True)
def keys_create(
    location: StoreLocation, user: str, tenant: str | None, scopes: tuple[str, ...], as_json: bool
) -> None:
    """Issue a key; its secret is printed once and never stored."""
    try:
        keymod.check_user(user)
        tenant_value = keymod.check_tenant(tenant)
    except SandboxError as exc:
        raise click.BadParameter(exc.message) from None
    with offline_store(location) as store:
        key, secret = keymod.new_key(user, tenant_value, scopes)
        store.add_key(key)
    wire = keymod.created_wire(key, secret)
    _emit(
        as_json, wire, lambda: click.echo(f"id: {key.id}\nsecret: {secret}\n(the secret is shown only now)")
    )


@keys.command("list")
@state_option
@click.option("--json", "as_json", is_flag=True)
def keys_list(location: StoreLocation, as_json: bool) -> None:
    """List keys (never a secret)."""
    with offline_store(location) as store:
        listed = [k.wire() for k in sorted(store.keys.values(), key=lambda k: k.created)]

    def text() -> None:
        for k in listed:
            revoked = f" revoked {k.revoked}" if k.revoked else ""
            click.echo(f"{k.id}  {k.user}  {k.tenant or '-'}  {','.join(k.scopes)}{revoked}")

    _emit(as_json, {"keys": listed}, text)


@keys.command("revoke")
@state_option
@click.argument("key_id")
def keys_revoke(location: StoreLocation, key_id: str) -> None:
    """Revoke a key (kept listed as revoked)."""
    with offline_store(location) as store:
        if store.revoke_key(key_id) is None:
            raise click.ClickException(f"no key {key_id!r}: see sandbox-gateway keys list")
    click.echo(f"revoked {key_id}")


# -- offline: nodes ---------------------------------------------------------------------------------


@main.group()
def nodes() -> None:
    """Add, list and remove admin-managed nodes in the state file while the gateway is stopped."""


@nodes.command("add")
@state_option
@click.argument("name")
@click.argument("endpoint")
@click.option("--token-file", default=None)
@click.option("--ca-file", default=None)
@click.option("--cert-file", default=None)
@click.option("--key-file", default=None)
def nodes_add(location: StoreLocation, name: str, endpoint: str, token_file: str | None, ca_file: str | None,
              cert_file: str | None, key_file: str | None) -> None:  # fmt: skip
    """Add node NAME at ENDPOINT (https://HOST:PORT, unix:///PATH or http://127.0.0.1:PORT)."""
    body = {"name": name, "endpoint": endpoint, "token_file": token_file, "ca_file": ca_file,
            "cert_file": cert_file, "key_file": key_file}  # fmt: skip
    body = {k: (str(Path(v).resolve()) if k.endswith("_file") and v else v) for k, v in body.items()}
    try:
        definition = node_def_from(convert_request(body, NodeAddRequest), Path("/"))
    except SandboxError as exc:
        raise click.BadParameter(exc.message) from None
    with offline_store(location) as store:
        if name in store.nodes:
            raise click.ClickException(f"a node named {name!r} exists: remove it first")
        store.add_node(definition)
    click.echo(f"added {name}")


@nodes.command("list")
@state_option
@click.option("--json", "as_json", is_flag=True)
def nodes_list(location: StoreLocation, as_json: bool) -> None:
    """List admin-managed nodes and their cordon flags."""
    with offline_store(location) as store:
        listed = [{"name": d.name, "endpoint": d.endpoint,
                   "cordoned": store.node_flags[d.name].cordoned if d.name in store.node_flags else False}
                  for d in sorted(store.nodes.values(), key=lambda d: d.name)]  # fmt: skip

    def text() -> None:
        for n in listed:
            click.echo(f"{n['name']}  {n['endpoint']}{'  cordoned' if n['cordoned'] else ''}")

    _emit(as_json, {"nodes": listed}, text)


@nodes.command("remove")
@state_option
@click.argument("name")
def nodes_remove(location: StoreLocation, name: str) -> None:
    """Remove node NAME (owners of its sandboxes are kept)."""
    with offline_store(location) as store:
        if not store.remove_node(name):
            raise click.ClickException(f"no admin-managed node {name!r}: see sandbox-gateway nodes list")
    click.echo(f"removed {name}")


# -- offline: the secrets key ----------------------------------------------------------------------


@main.group("secrets-key")
def secrets_key() -> None:
    """Make the key that seals tenant secrets (give it to serve --secrets-key-file)."""


@secrets_key.command("new")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
def secrets_key_new(path: Path) -> None:
    """Write a new random key (64 hex characters, mode 0600) to PATH; never overwrites a file.

    Keep it with the state file's backups: without it the secrets stored cannot be read."""
    try:
        new_key_file(path)
    except FileExistsError:
        raise click.ClickException(
            f"{path} exists: a key is never overwritten (secrets sealed with it would be lost)"
        ) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None
    click.echo(f"wrote a new secrets key to {path}")


# -- offline: quotas --------------------------------------------------------------------------------


@main.group()
def quotas() -> None:
    """Set and list tenant quotas (CPUs, memory, sandboxes) while the gateway is stopped."""


@quotas.command("set")
@state_option
@click.argument("tenant")
@click.option(
    "--cpus", type=click.IntRange(min=0), default=None, help="Most vCPUs the tenant's sandboxes hold."
)
@click.option("--memory-mb", type=click.IntRange(min=0), default=None, help="Most memory, MiB.")
@click.option("--sandboxes", type=click.IntRange(min=0), default=None, help="Most sandboxes.")
def quotas_set(
    location: StoreLocation, tenant: str, cpus: int | None, memory_mb: int | None, sandboxes: int | None
) -> None:
    """Set TENANT's quota (``default`` for keys without a tenant); an amount left out has no limit."""
    try:
        stored = keymod.check_tenant(tenant)
    except SandboxError as exc:
        raise click.BadParameter(exc.message) from None
    with offline_store(location) as store:
        store.set_quota(stored, Quota(cpus, memory_mb, sandboxes))
    click.echo(f"quota of {tenant}: cpus={cpus} memory_mb={memory_mb} sandboxes={sandboxes}")


@quotas.command("list")
@state_option
def quotas_list(location: StoreLocation) -> None:
    """List tenant quotas."""
    with offline_store(location) as store:
        for tenant, q in sorted(store.quotas.items()):
            click.echo(
                f"{tenant or 'default'}  cpus={q.max_cpus} memory_mb={q.max_memory_mb} sandboxes={q.max_sandboxes}"
            )


# -- migrate: SQLite into PostgreSQL ----------------------------------------------------------------


@main.command()
@click.option("--from", "source", type=click.Path(path_type=Path, dir_okay=False, exists=True), required=True,
              help="The SQLite state file of a stopped gateway.")  # fmt: skip
@click.option("--to", "target", required=True,
              help="postgresql://USER@HOST[:PORT]/DB of an empty database (the password as for --database).")  # fmt: skip
def migrate(source: Path, target: str) -> None:
    """Copy a stopped gateway's SQLite state into an empty PostgreSQL database, in one transaction.

    Refused while a gateway serves either store, or when the database already holds a gateway's state. The
    SQLite file is left as it was (brought to the current schema first, as serve would)."""
    try:
        check_database_url(target)
    except StateError as exc:
        raise click.BadParameter(str(exc), param_hint="--to") from None
    try:
        src = open_store(StoreLocation(state=source))
    except (StateLocked, StateError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        try:
            dst = open_store(StoreLocation(database=target))
        except (StateLocked, StateError) as exc:
            raise click.ClickException(str(exc)) from None
        try:
            if dst.holds_state():
                raise click.ClickException(
                    f"the database {target} already holds a gateway's state; migrate copies into an empty one "
                    "only, and nothing was changed: give a new database (createdb), or drop that one's tables"
                )
            counts = copy_state(src, dst)
            copied = {name: len(dst.select(name, TABLES[name].key[:1])) for name in counts}
            if copied != counts:  # pragma: no cover - the copy is one transaction; this says so on the record
                raise click.ClickException(f"the copy does not match the source: {copied} against {counts}")
        finally:
            dst.close()
    finally:
        src.close()
    click.echo(f"copied {sum(counts.values())} rows from {source} to {target}:")
    for name, n in counts.items():
        click.echo(f"  {name}: {n}")
    click.echo(
        "local files: serve the first replica with --database and --data-dir DIR, with the SSH host keys "
        f"({source.name}.ssh_host_*_key, renamed gateway.ssh_host_*_key) and jobs/ copied into DIR; it puts the "
        "keys into the database for every replica (docs/ha.md)"
    )


if __name__ == "__main__":  # pragma: no cover
    main()
