"""Assembles sandboxd: backend, image store, audit log, manager, HTTP app, metrics; runs until signalled."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from sbx.api.network_policy import MODE_ORDER, mode_rank
from sbx.backends.base import BackendError
from sbx.backends.gvisor import GVisorBackend
from sbx.images.store import ImageStore
from sbx.node.audit import AuditLog
from sbx.node.config import NodeConfig, resolve_capacity
from sbx.node.context import NodeContext
from sbx.node.http import error_middleware, make_guard
from sbx.node.manager import SandboxManager
from sbx.node.metrics import NodeMetrics, NodeSnapshot
from sbx.node.pools import Pools
from sbx.node.routes import all_routes
from sbx.node.sampler import MetricsSampler, running_targets
from sbx.serving import server_tls, start_metrics_server, unix_listener
from sbx.statefile import try_lock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    """Where and how sandboxd listens (validated by the command line before this is built)."""

    state_dir: Path
    socket_path: Path | None
    listen: tuple[str, int] | None
    token: str | None
    tls_cert: Path | None
    tls_key: Path | None
    node_id: str | None
    metrics_listen: tuple[str, int] | None


class StateDirLocked(Exception):
    """Another sandboxd already serves this state directory."""


def lock_state_dir(state_dir: Path) -> int:
    """Hold an exclusive lock on the state dir for the life of the process; two servers would corrupt it."""
    fd = try_lock(state_dir / "sandboxd.lock")
    if fd is None:
        raise StateDirLocked(
            f"another sandboxd is already using the state directory {state_dir}; stop it or pass another --state-dir"
        )
    return fd


def within_backend(config: NodeConfig, network_modes: frozenset[str]) -> NodeConfig:
    """The config with its network ceiling lowered to what the backend enforces, so that capabilities and
    create validation never promise a mode the sandboxes would not get. The default policy must fit."""
    enforced = [m for m in MODE_ORDER if m in network_modes]
    loosest = enforced[-1] if enforced else "none"
    if mode_rank(config.network.ceiling) <= mode_rank(loosest):
        return config
    if mode_rank(config.network.default.mode) > mode_rank(loosest):
        raise BackendError(
            f"the configured default network mode {config.network.default.mode} is not enforced by this "
            f"backend (it enforces: {', '.join(enforced)}); set [network] default to one of those"
        )
    log.warning(
        "network ceiling lowered to what the backend enforces",
        extra={"configured": config.network.ceiling, "effective": loosest},
    )
    network = dataclasses.replace(config.network, ceiling=loosest)
    return dataclasses.replace(config, network=network)


async def serve(config: NodeConfig, options: ServerOptions) -> None:
    """Run sandboxd until SIGTERM or SIGINT; sandboxes keep running after it stops."""
    lock_fd = lock_state_dir(options.state_dir)
    backend = GVisorBackend(
        options.state_dir,
        config.paths.agent_path,
        pooled_disk_mb=config.defaults.disk_mb,
        egress=config.egress,
        platform=config.gvisor.platform,
    )
    backend.check()
    config = within_backend(config, backend.network_modes)
    images = ImageStore(config.paths.images_dir)
    audit = AuditLog(options.state_dir / "audit")
    manager = SandboxManager(
        config, options.state_dir, backend, images, audit,
        capacity=resolve_capacity(config.capacity, options.state_dir), node_id=options.node_id,
    )  # fmt: skip
    pools = Pools(manager, manager.image_service, options.state_dir / "pool")
    metrics = NodeMetrics(lambda: _snapshot(manager, pools))
    sampler = MetricsSampler(lambda: running_targets(manager), backend.usage)
    manager.on_forget.append(sampler.forget)
    ctx = NodeContext(
        config=config, backend=backend, manager=manager, audit=audit, node_name=options.node_id or "",
        on_create=metrics.observe_create, pools=pools, sampler=sampler,
        runtime=backend.runtime_report(),
    )  # fmt: skip
    await backend.start()
    await manager.start()
    await asyncio.to_thread(images.clean_leftovers)
    await pools.start()
    await sampler.start()

    app = web.Application(
        middlewares=[error_middleware, make_guard(
            frozenset(config.server.allowed_hosts), frozenset(config.server.allowed_origins), options.token
        )],
        client_max_size=1024 * 1024,
    )  # fmt: skip
    app.add_routes(all_routes(ctx))
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    sites: list[web.BaseSite] = []
    if options.socket_path is not None:
        sites.append(web.SockSite(runner, unix_listener(options.socket_path)))
    if options.listen is not None:
        host, port = options.listen
        sites.append(
            web.TCPSite(runner, host, port, ssl_context=server_tls(options.tls_cert, options.tls_key))
        )
    for site in sites:
        await site.start()
    metrics_runner = None
    if options.metrics_listen is not None:
        metrics_runner = await start_metrics_server(metrics, *options.metrics_listen)
    log.info(
        "sandboxd serving",
        extra={
            "socket": str(options.socket_path or ""),
            "listen": options.listen,
            "state_dir": str(options.state_dir),
        },
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("sandboxd stopping; sandboxes keep running")
    await runner.cleanup()
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    await sampler.close()
    await pools.close()
    await manager.image_service.close()
    await manager.close()
    await backend.close()
    if options.socket_path is not None:
        options.socket_path.unlink(missing_ok=True)
    os.close(lock_fd)


def _snapshot(manager: SandboxManager, pools: Pools) -> NodeSnapshot:
    free = manager.free()
    return NodeSnapshot(
        sandboxes_by_state=manager.count_by_state(),
        processes_running=manager.processes_running(),
        pool_target=pools.target(),
        pool_ready=pools.ready(),
        pool_booting=pools.booting(),
        capacity_cpus=manager.capacity.cpus,
        capacity_memory_mb=manager.capacity.memory_mb,
        capacity_disk_mb=manager.capacity.disk_mb,
        free_cpus=free.cpus,
        free_memory_mb=free.memory_mb,
        free_disk_mb=free.disk_mb,
        cordoned=manager.cordoned,
    )
