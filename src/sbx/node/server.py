"""Assembles sandboxd: backend, image store, audit log, manager, HTTP app, metrics; runs until signalled."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
from aiohttp import web

from sbx.api.network_policy import MODE_ORDER, mode_rank
from sbx.backends.base import BackendError
from sbx.images.store import ImageStore
from sbx.net.limits import raise_descriptor_limit
from sbx.node.activity import activity_middleware
from sbx.node.audit import AuditLog
from sbx.node.backend_kinds import make_backend
from sbx.node.capacity import host_shortage, read_host
from sbx.node.config import NodeConfig, resolve_capacity
from sbx.node.context import NodeContext
from sbx.node.manager import SandboxManager
from sbx.node.metrics import NodeMetrics, NodeSnapshot
from sbx.node.pools import Pools
from sbx.node.reservations import Reservations
from sbx.node.routes import all_routes
from sbx.node.sampler import MetricsSampler, running_targets, target_of
from sbx.statefile import try_lock
from sbx.web.guard import make_guard
from sbx.web.http import JSON_BODY_CAP, error_middleware
from sbx.web.serve import Listen, metrics_server, run, server_tls

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
    network = msgspec.structs.replace(config.network, ceiling=loosest)
    return dataclasses.replace(config, network=network)


def parking_within_backend(config: NodeConfig, refused: str | None) -> NodeConfig:
    """The config with parking off (``park_after_secs`` 0) where the backend says parking is unsafe here
    (``Backend.parking_refused``): the node then never parks, and says why once."""
    if refused is None or config.parking.park_after_secs <= 0:
        return config
    log.warning(
        "parking is off on this runtime", extra={"configured_park_after_secs": config.parking.park_after_secs,
                                                 "reason": refused},
    )  # fmt: skip
    return dataclasses.replace(config, parking=dataclasses.replace(config.parking, park_after_secs=0))


async def serve(config: NodeConfig, options: ServerOptions) -> None:
    """Run sandboxd until SIGTERM or SIGINT; sandboxes keep running after it stops."""
    lock_fd = lock_state_dir(options.state_dir)
    try:
        app = build_app(config, options)
        tls = server_tls(options.tls_cert, options.tls_key) if options.listen is not None else None
        listen = Listen(options.socket_path, options.listen, tls)

        def ready() -> None:
            log.info(
                "sandboxd serving",
                extra={"socket": str(options.socket_path or ""), "listen": options.listen,
                       "state_dir": str(options.state_dir)},
            )  # fmt: skip

        await run(
            app, listen, ready=ready, idle_timeout_secs=config.server.idle_timeout_secs,
            max_unauthenticated=config.server.max_unauthenticated,
        )  # fmt: skip
        log.info("sandboxd stopped; sandboxes keep running")
    finally:
        os.close(lock_fd)


def build_app(config: NodeConfig, options: ServerOptions) -> web.Application:
    """sandboxd's application: every component built here, started and stopped in order by ``cleanup_ctx``
    (backend, manager, image leftovers, pools, metrics sampler, the loopback metrics server)."""
    # Each sandbox holds a descriptor or two of sandboxd's (sbx.node.capacity): the soft limit (1024 under
    # systemd) would cap a node at a few hundred sandboxes, the hard one (LimitNOFILE) is what the host allows.
    raise_descriptor_limit()
    backend = make_backend(config, options.state_dir)
    backend.check()
    config = parking_within_backend(within_backend(config, backend.network_modes), backend.parking_refused)
    images = ImageStore(config.paths.images_dir)
    audit = AuditLog(options.state_dir / "audit")
    reservations = Reservations(
        resolve_capacity(config.capacity, options.state_dir),
        max_sandboxes=config.capacity.max_sandboxes,
        host_check=lambda: host_shortage(read_host()),
    )
    manager = SandboxManager(
        config, options.state_dir, backend, images, audit, reservations, node_id=options.node_id
    )
    pools = Pools(
        manager, backend, manager.image_service, reservations, config.defaults, config.pools,
        options.state_dir / "pool", manager.root, park_ready=config.parking.park_after_secs > 0,
    )  # fmt: skip
    manager.pools = pools
    metrics = NodeMetrics(lambda: _snapshot(manager, pools))
    sampler = MetricsSampler(lambda: running_targets(manager), backend.usage)
    manager.on_forget.append(sampler.forget)
    manager.parking.on_parked.append(lambda sandbox: sampler.park(target_of(sandbox)))
    manager.parking.on_unparked.append(lambda sandbox: sampler.unpark(sandbox.record.id))
    ctx = NodeContext(
        config=config, backend=backend, manager=manager, audit=audit, node_name=options.node_id or "",
        on_create=metrics.observe_create, pools=pools, sampler=sampler,
    )  # fmt: skip

    app = web.Application(
        middlewares=[error_middleware, make_guard(
            frozenset(config.server.allowed_hosts), frozenset(config.server.allowed_origins), options.token
        ), activity_middleware],
        client_max_size=JSON_BODY_CAP,
    )  # fmt: skip
    app.add_routes(all_routes(ctx))

    async def run_backend(app: web.Application) -> AsyncIterator[None]:
        await backend.start()
        yield
        await backend.close()

    async def run_manager(app: web.Application) -> AsyncIterator[None]:
        await manager.start()
        await asyncio.to_thread(images.clean_leftovers)
        yield
        await manager.image_service.close()
        await manager.close()

    async def run_pools(app: web.Application) -> AsyncIterator[None]:
        await pools.start()
        yield
        await pools.close()

    async def run_sampler(app: web.Application) -> AsyncIterator[None]:
        await sampler.start()
        yield
        await sampler.close()

    app.cleanup_ctx.extend([run_backend, run_manager, run_pools, run_sampler])
    if options.metrics_listen is not None:
        app.cleanup_ctx.append(metrics_server(metrics, options.metrics_listen))
    return app


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
        sandboxes_parked=manager.parked_count(),
        parks=manager.parking.parks,
        unparks=manager.parking.unparks,
    )
