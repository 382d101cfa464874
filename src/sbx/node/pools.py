"""Warm pools: sandboxes booted ahead of creates, per configured image (``[[pools]]`` in the config).

Each pool keeps ``size`` sandboxes of its image booted and unassigned, with the default resources
(``[defaults]`` cpus, memory_mb, disk_mb), network ``none``, no env, no labels and no name. A create that
fits (same image, exactly those resources, network ``none``, no volumes or snapshot) takes a ready one:
:meth:`SandboxManager.adopt` gives it the request's name, labels, env and idle timeout, and the pool refills
in the background. Nothing has run in a pooled sandbox but ``true`` once, as the sandbox user (warming
gVisor's caches of the dynamic loader and libc, so the first command after a take is as fast as later ones:
about 4 ms less on systrap, measured), so its ``/tmp``, home and processes are those of a fresh boot; env is
given per process, so nothing inside has to change.

Pooled sandboxes are not listed, never idle out, and count against the node's free capacity. A pool only
boots while the node has room for one more sandbox of the default size (its capacity, ``max_sandboxes`` and the
host's live headroom: sbx.node.reservations), and a failed boot or install is retried after :data:`RETRY_SECS`.
Cordoning the node leaves the pools as they are. Where parking is on (``[parking] park_after_secs`` > 0), a
ready sandbox is parked as soon as it is warm (nothing runs in it: it would only spin the sentry's timers) and
handed over parked; its first request wakes it (sbx.node.parking).

On disk: ``<state>/pool/<id>`` (an empty directory) marks a pooled sandbox from before its boot until it
is adopted. Pooled sandboxes are destroyed when sandboxd stops, and whatever a killed sandboxd left marked
(and not adopted) is destroyed at the next start: a pool never serves a sandbox it did not boot itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from sbx.agent.client import AgentClient, AgentError
from sbx.api.errors import SandboxError
from sbx.api.network_policy import NetworkPolicy
from sbx.api.node import Resources
from sbx.api.requests import CreateSpec
from sbx.backends.base import Backend, BackendError, GuestUser
from sbx.images.store import InstalledImage
from sbx.node.config import DefaultsConfig, PoolConfig
from sbx.node.host import SandboxHost
from sbx.node.images import ImageService
from sbx.node.records import SandboxRecord, SandboxState, new_sandbox_id, utc_now
from sbx.node.reservations import Reservations

log = logging.getLogger(__name__)

#: Wait before trying again after a failed boot or install, and between capacity checks while full, in seconds.
RETRY_SECS = 5.0
#: Delay before a pool refills after a take, in seconds: a boot takes the CPU for a moment, and the sandbox
#: just handed out runs its first command meanwhile (on a small host that doubled its latency).
REFILL_DELAY_SECS = 0.3
#: How long stopping sandboxd waits for the pooled sandboxes to be destroyed, in seconds.
CLOSE_TIMEOUT_SECS = 15.0
#: The warm-up run of a pooled sandbox: its agent handle (never one the node gives a process) and how long
#: it may take, in seconds, before the sandbox is pooled without it.
WARM_UP_HANDLE = 0xFFFF_FFFF
WARM_UP_TIMEOUT_SECS = 10.0


@dataclass
class PooledSandbox:
    """A booted, unassigned sandbox: its record-to-be, agent connection, image and marker directory."""

    record: SandboxRecord
    agent: AgentClient
    image: InstalledImage
    marker: Path
    #: Parked by the pool (its processes stopped); the node counts it parked once it is adopted.
    parked: bool = False

    def release(self) -> None:
        """Drop the pool's marker: the sandbox is someone's now (called once its record is saved)."""
        shutil.rmtree(self.marker, ignore_errors=True)


@dataclass
class _Pool:
    config: PoolConfig
    ready: list[PooledSandbox] = field(default_factory=list)
    booting: int = 0
    paused: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class Pools:
    """Every configured pool of the node; methods run on the server's event loop."""

    def __init__(
        self,
        host: SandboxHost,
        backend: Backend,
        images: ImageService,
        reservations: Reservations,
        defaults: DefaultsConfig,
        pools: tuple[PoolConfig, ...],
        directory: Path,
        sandboxes_dir: Path,
        park_ready: bool = False,
    ) -> None:
        """``host`` boots pooled sandboxes (and adopts them, keeping them under ``sandboxes_dir``);
        ``reservations`` counts what the pools hold; ``directory`` keeps their markers; ``park_ready``: park
        each ready sandbox (parking is on)."""
        self.host = host
        self.backend = backend
        self.images = images
        self.reservations = reservations
        self.defaults = defaults
        self.directory = directory
        self.sandboxes_dir = sandboxes_dir
        self.park_ready = park_ready
        self.size = Resources(defaults.cpus, defaults.memory_mb, defaults.disk_mb)
        self._pools = {p.image: _Pool(p) for p in pools if p.size > 0}
        self._destroying: set[asyncio.Task[None]] = set()
        reservations.add_holder("pools", self._held)
        images.before_replace = self.drain
        images.after_install = self._resume

    # -- start and stop ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Destroy what an earlier run left in the pools, then fill them in the background."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for marker in sorted(self.directory.iterdir()):
            if (self.sandboxes_dir / marker.name / "sandbox.json").exists():
                shutil.rmtree(marker, ignore_errors=True)  # adopted just before a kill: the manager has it
            else:
                log.info("destroying a pooled sandbox left by an earlier run", extra={"sandbox": marker.name})
                self._destroy_soon(marker.name, marker)
        loop = asyncio.get_running_loop()
        for pool in self._pools.values():
            pool.task = loop.create_task(self._fill(pool))

    async def close(self) -> None:
        """Stop filling and destroy the ready sandboxes (a stopped node holds no pool)."""
        for pool in self._pools.values():
            if pool.task is not None:
                pool.task.cancel()
        for pool in self._pools.values():
            if pool.task is not None:
                try:
                    await pool.task
                except asyncio.CancelledError:
                    pass
            for pooled in pool.ready:
                self._destroy_soon(pooled.record.id, pooled.marker, pooled.agent)
            pool.ready.clear()
        if self._destroying:
            await asyncio.wait(set(self._destroying), timeout=CLOSE_TIMEOUT_SECS)

    # -- what the node reports --------------------------------------------------------------------------

    def _held(self) -> list[Resources]:
        """What the ready and booting pooled sandboxes hold (the reservations' holder ``pools``)."""
        return [self.size] * sum(len(p.ready) + p.booting for p in self._pools.values())

    def target(self) -> dict[str, int]:
        return {image: p.config.size for image, p in self._pools.items()}

    def ready(self) -> dict[str, int]:
        return {image: len(p.ready) for image, p in self._pools.items()}

    def booting(self) -> dict[str, int]:
        return {image: p.booting for image, p in self._pools.items()}

    # -- taking -------------------------------------------------------------------------------------------

    def fits(self, image: str, req: CreateSpec) -> bool:
        """Whether a pooled sandbox of ``image`` is exactly what ``req`` would boot."""
        return (
            image in self._pools
            and (req.cpus, req.memory_mb, req.disk_mb)
            == (self.size.cpus, self.size.memory_mb, self.size.disk_mb)
            and req.network.mode == "none"
            and not req.volumes
            and req.snapshot_id is None
        )

    def take(self, image: str, req: CreateSpec) -> PooledSandbox | None:
        """A ready sandbox for ``req`` (removed from the pool, which refills), or None when none fits."""
        if not self.fits(image, req):
            return None
        pool = self._pools[image]
        while pool.ready:
            pooled = pool.ready.pop(0)
            if pooled.agent.closed.is_set():  # died while waiting: never hand it out
                log.warning(
                    "a pooled sandbox's agent went away; destroying it", extra={"sandbox": pooled.record.id}
                )
                self._destroy_soon(pooled.record.id, pooled.marker, pooled.agent)
                continue
            asyncio.get_running_loop().call_later(REFILL_DELAY_SECS, pool.wake.set)
            return pooled
        pool.wake.set()
        return None

    # -- filling ------------------------------------------------------------------------------------------

    async def _fill(self, pool: _Pool) -> None:
        while True:
            try:
                done = await self._fill_once(pool)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("pool refill failed", extra={"image": pool.config.image})
                done = False
            pool.wake.clear()
            try:
                await asyncio.wait_for(pool.wake.wait(), timeout=None if done else RETRY_SECS)
            except TimeoutError:
                pass

    async def _fill_once(self, pool: _Pool) -> bool:
        """Boot until the pool is full; False when it stopped short (to be retried after a pause)."""
        while len(pool.ready) + pool.booting < pool.config.size:
            if pool.paused:
                return True  # resumed (and woken) when the install that paused it ends
            if not self.reservations.fits(self.size):
                return False
            pool.booting += 1
            try:
                try:
                    image = await self.images.ensure(pool.config.image)
                except SandboxError as exc:
                    log.warning(
                        "pool image could not be installed",
                        extra={"image": pool.config.image, "error": exc.message},
                    )
                    return False
                if pool.paused:
                    return True
                pool.ready.append(await self._boot(image))
            finally:
                pool.booting -= 1
        return True

    async def _boot(self, image: InstalledImage) -> PooledSandbox:
        defaults = self.defaults
        record = SandboxRecord(
            id=new_sandbox_id(self.host.node_id),
            state=SandboxState.RUNNING,
            image=image.reference,
            cpus=defaults.cpus,
            memory_mb=defaults.memory_mb,
            disk_mb=defaults.disk_mb,
            network=NetworkPolicy("none"),
            idle_timeout_secs=defaults.idle_timeout_secs,
            created_at=utc_now(),
        )
        marker = self.directory / record.id
        marker.mkdir(mode=0o700)
        try:
            agent = await self.host.boot(record, image)
        except BaseException:
            shutil.rmtree(marker, ignore_errors=True)
            raise
        await _warm_up(agent, image, self.backend.guest)
        parked = False
        if self.park_ready:
            try:
                await self.backend.park(record.id)
                parked = True
            except BackendError as exc:  # it is handed over awake, as without parking
                log.warning("pooled sandbox not parked", extra={"sandbox": record.id, "error": str(exc)})
        log.info(
            "pooled sandbox ready", extra={"sandbox": record.id, "image": image.reference, "parked": parked}
        )
        return PooledSandbox(record, agent, image, marker, parked)

    # -- image changes --------------------------------------------------------------------------------------

    async def drain(self, image: str) -> None:
        """Before ``image`` is replaced: stop its pool, wait for its boots, destroy its ready sandboxes."""
        pool = self._pools.get(image)
        if pool is None:
            return
        pool.paused = True
        while pool.booting:
            await asyncio.sleep(0.05)
        for pooled in pool.ready:
            self._destroy_soon(pooled.record.id, pooled.marker, pooled.agent)
        pool.ready.clear()

    def _resume(self, image: str) -> None:
        pool = self._pools.get(image)
        if pool is not None:
            pool.paused = False
            pool.wake.set()

    def _destroy_soon(self, sandbox_id: str, marker: Path, agent: AgentClient | None = None) -> None:
        async def destroy() -> None:
            if agent is not None:
                await agent.close()
            try:
                await self.backend.destroy(sandbox_id)
            except (BackendError, OSError) as exc:
                log.error("pooled sandbox teardown failed", extra={"sandbox": sandbox_id, "error": str(exc)})
            shutil.rmtree(marker, ignore_errors=True)

        task = asyncio.get_running_loop().create_task(destroy())
        self._destroying.add(task)
        task.add_done_callback(self._destroying.discard)


class _ExitSink:
    """Discards a process's output and resolves ``exited`` with its exit status."""

    def __init__(self) -> None:
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_output(self, stream: str, data: bytes) -> None:
        pass

    async def on_exit(self, exit_code: int) -> None:
        if not self.exited.done():
            self.exited.set_result(exit_code)


async def _warm_up(agent: AgentClient, image: InstalledImage, guest: GuestUser) -> None:
    """Run ``true`` once as ``guest`` (best effort: an image without it, or a slow run, just stays cold)."""
    sink = _ExitSink()
    path = image.config.env.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    try:
        await agent.spawn(WARM_UP_HANDLE, ["true"], {"PATH": path}, "/", guest.uid, guest.gid, sink=sink)
        await asyncio.wait_for(sink.exited, WARM_UP_TIMEOUT_SECS)
    except (AgentError, TimeoutError) as exc:
        log.info("pooled sandbox not warmed up", extra={"image": image.reference, "error": str(exc)})
    finally:
        with contextlib.suppress(AgentError):
            await agent.forget(WARM_UP_HANDLE)
