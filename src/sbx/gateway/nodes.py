"""The node registry: each node's client, its last status, and the health poller.

Health (spec: Node as seen by the gateway): every ``poll_interval_secs`` (5) the gateway asks each node for
``GET /v1/node``. After ``failures_unhealthy`` (3) failed polls in a row a node takes no new sandboxes and calls
on its sandboxes answer 503; once it has been down ``lost_after_secs`` (300) it is lost. A node that answers again
is healthy at once and its sandboxes are reconciled from its own listing. A cordon the gateway set (or a drain)
is restored on every poll, since a node clears its own cordon when it restarts. A change of the cordon
(``set_cordon``) and a poll never interleave: a poll that read the node before an uncordon would otherwise
restore the cordon being lifted, and nothing would ever lift it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from msgspec import UNSET
from msgspec.structs import replace as msgspec_replace

from sbx.api.errors import SandboxError
from sbx.api.gateway import GatewayNode
from sbx.api.node import Defaults, NodeStatus, Resources
from sbx.gateway.nodeclient import NodeClient, connect, describe
from sbx.gateway.placement import Candidate
from sbx.gateway.state import NodeDef, now_rfc3339

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_SECS = 5.0
DEFAULT_FAILURES_UNHEALTHY = 3
DEFAULT_LOST_AFTER_SECS = 300.0
DEFAULT_FORGET_INTERVAL_SECS = 60.0

_NONE = Resources(0, 0, 0)


@dataclass
class Node:
    """One node: its definition, client, and what the poller last saw."""

    definition: NodeDef
    client: NodeClient
    healthy: bool = False
    answered_once: bool = False
    failures: int = 0
    #: Monotonic and wall time of the first failed poll of the current outage (None while answering).
    down_since_mono: float | None = None
    down_since: str | None = None
    last_seen: str | None = None
    error: str | None = None
    status: NodeStatus | None = None
    #: Monotonic time of the last reconcile from the node's listing.
    reconciled_at: float = 0.0
    poll_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def name(self) -> str:
        return self.definition.name

    def is_lost(self, lost_after_secs: float) -> bool:
        return (
            not self.healthy
            and self.down_since_mono is not None
            and time.monotonic() - self.down_since_mono >= lost_after_secs
        )

    @property
    def defaults(self) -> Defaults | None:
        """What a create on this node gets for what it omits, as the node last reported (None: unknown)."""
        status = self.status
        return status.defaults if status is not None and status.defaults is not UNSET else None

    def offers(self, capability: str) -> bool:
        """Whether the node's last status has the capability flag (False before its first answer)."""
        status = self.status
        return status is not None and status.capabilities.capabilities.get(capability, False)

    def candidate(self, cordoned: bool) -> Candidate:
        status = self.status
        return Candidate(
            name=self.name,
            taking_new=self.healthy and not cordoned and not (status is not None and status.cordoned),
            capacity=status.capacity if status is not None else _NONE,
            free=status.free if status is not None else _NONE,
            running=status.running if status is not None else 0,
            defaults=self.defaults,
        )

    def took(self, resources: Resources) -> None:
        """Count a sandbox just made here against the last status until the next poll, so creates in quick
        succession spread out instead of all going to the node that looked emptiest a moment ago."""
        status = self.status
        if status is None:
            return
        free = status.free
        self.status = msgspec_replace(
            status,
            free=Resources(
                max(0, free.cpus - resources.cpus),
                max(0, free.memory_mb - resources.memory_mb),
                max(0, free.disk_mb - resources.disk_mb),
            ),
            running=status.running + 1,
        )


def connect_node(definition: NodeDef) -> Node:
    """A node with its own client (keep-alive); raises ``InvalidRequest`` or ``OSError``/``ValueError`` for a
    bad endpoint or unreadable files."""
    return Node(definition, connect(definition))


#: Called after a node answered a poll again (first answer or after an outage) to reconcile its sandboxes.
ReconcileHook = Callable[[Node], Awaitable[None]]


class Registry:
    """Every node the gateway knows, and the poller that keeps their health and status."""

    def __init__(
        self,
        *,
        poll_interval_secs: float = DEFAULT_POLL_INTERVAL_SECS,
        failures_unhealthy: int = DEFAULT_FAILURES_UNHEALTHY,
        lost_after_secs: float = DEFAULT_LOST_AFTER_SECS,
        wanted_cordon: Callable[[str], bool] = lambda name: False,
    ) -> None:
        self.nodes: dict[str, Node] = {}
        self.poll_interval_secs = poll_interval_secs
        self.failures_unhealthy = failures_unhealthy
        self.lost_after_secs = lost_after_secs
        self.wanted_cordon = wanted_cordon
        self.on_answering_again: list[ReconcileHook] = []
        #: Held (inside the poll's lock) while a cordon is set or restored: with several gateway replicas, a lock
        #: they share, so one never restores a cordon another is lifting (docs/ha.md). One gateway: nothing.
        self.cordon_guard: Callable[[str], contextlib.AbstractAsyncContextManager[object]] = lambda name: (
            contextlib.nullcontext()
        )
        #: Whether the cordon is still wanted, asked under ``cordon_guard`` before one is restored (replicas
        #: catch up with each other's changes first).
        self.still_wanted: Callable[[str], Awaitable[bool]] = _still_wanted(self)
        self._task: asyncio.Task[None] | None = None

    def add(self, node: Node) -> None:
        self.nodes[node.name] = node

    async def remove(self, name: str) -> None:
        node = self.detach(name)
        if node is not None:
            await node.client.close()

    def detach(self, name: str) -> Node | None:
        """Take the node out at once (no longer listed, polled or placed on); closing its client is the caller's."""
        return self.nodes.pop(name, None)

    def get(self, name: str) -> Node | None:
        return self.nodes.get(name)

    def healthy(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.healthy]

    def candidates(self) -> list[Candidate]:
        return [n.candidate(self.wanted_cordon(n.name)) for n in self.nodes.values()]

    async def start(self) -> None:
        await asyncio.gather(*(self.poll(n) for n in list(self.nodes.values())))
        self._task = asyncio.create_task(self._loop(), name="gateway-node-poller")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for node in list(self.nodes.values()):
            await node.client.close()

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            await asyncio.gather(*(self.poll(n) for n in list(self.nodes.values())), return_exceptions=True)
            await asyncio.sleep(max(0.0, self.poll_interval_secs - (time.monotonic() - started)))

    async def poll(self, node: Node) -> None:
        """One health poll of ``node``; never raises (a failure is recorded on the node)."""
        async with node.poll_lock:
            timeout = max(1.0, min(self.poll_interval_secs, 5.0))
            try:
                status = await node.client.status(timeout_secs=timeout)
                if self.wanted_cordon(node.name) and not status.cordoned:
                    # The node restarted (a restart clears its own cordon): restore ours.
                    async with self.cordon_guard(node.name):
                        if await self.still_wanted(node.name):
                            status = await node.client.cordon(True, timeout_secs=timeout)
            except Exception as exc:  # noqa: BLE001 - any failure is a failed poll
                self._failed(node, exc)
                return
            was_healthy = node.healthy
            node.status = status
            node.failures = 0
            node.healthy = True
            node.answered_once = True
            node.down_since_mono = None
            node.down_since = None
            node.error = None
            node.last_seen = now_rfc3339()
            if not was_healthy:
                log.info("node answering", extra={"node": node.name})
                for hook in self.on_answering_again:
                    try:
                        await hook(node)
                    except Exception:
                        log.exception("reconciling node failed", extra={"node": node.name})

    async def set_cordon(self, node: Node, cordoned: bool, record: Callable[[], Awaitable[None]]) -> None:
        """Tell ``node`` to take new sandboxes or not, then ``record`` the wish (the gateway's store), both under
        the poll's lock so no poll restores a cordon while it is being lifted. The node is told first: a node
        that does not answer raises (``BadGateway``) and nothing is recorded."""
        async with node.poll_lock, self.cordon_guard(node.name):
            node.status = await node.client.cordon(cordoned)
            await record()

    def _failed(self, node: Node, exc: BaseException) -> None:
        node.failures += 1
        node.error = exc.message if isinstance(exc, SandboxError) else describe(exc)
        if node.down_since_mono is None:
            node.down_since_mono = time.monotonic()
            node.down_since = now_rfc3339()
        if node.healthy and node.failures >= self.failures_unhealthy:
            node.healthy = False
            log.warning("node not answering", extra={"node": node.name, "failures": node.failures})
        elif not node.answered_once and node.failures >= self.failures_unhealthy:
            node.healthy = False

    def node_wire(self, node: Node, cordoned: bool) -> GatewayNode:
        """The spec's Node record (plus ``cordoned``, ``lost`` and ``from_node_file``)."""
        return GatewayNode(
            name=node.name, endpoint=node.definition.endpoint, healthy=node.healthy, last_seen=node.last_seen,
            cordoned=cordoned, lost=node.is_lost(self.lost_after_secs), from_node_file=node.definition.from_file,
            error=node.error if node.error is not None else UNSET,
            status=node.status if node.status is not None else UNSET,
        )  # fmt: skip


def _still_wanted(registry: Registry) -> Callable[[str], Awaitable[bool]]:
    async def still_wanted(name: str) -> bool:
        return registry.wanted_cordon(name)

    return still_wanted
