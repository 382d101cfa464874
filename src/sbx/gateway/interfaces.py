"""The narrow interfaces the gateway's parts are given instead of the whole ``Gateway`` (issue 34): each part's
constructor names the few it uses, so reading one controller needs only these and its own module, and a unit test
builds it from stand-ins without a gateway. ``Gateway`` provides every one of them (structurally); the store
(``store.base.Store``), the node registry (``nodes.Registry``), the sandbox service (``sandboxes.Sandboxes``) and
the secrets (``secrets.Secrets``) are classes of their own and are passed as they are.

Kubernetes' controllers (a client and informers, never the API server) and E2B's orchestrator (placement as an
interface) are the models.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from sbx.gateway.nodes import Node

#: Seconds on a monotonic clock (``time.monotonic`` unless a test gives another).
Clock = Callable[[], float]
MONOTONIC: Clock = time.monotonic


class Writes(Protocol):
    """Store writes off the event loop (a commit is an fsync)."""

    async def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a worker thread; its result."""


class AuditSink(Protocol):
    """The gateway's audit log (one JSON line per entry; nothing when the gateway keeps none)."""

    def record_audit(self, **fields: Any) -> None:
        """Record one entry (``kind``, ``type``, ``key_id``, ``user``, ``tenant`` ... as the log's format has)."""


class Leadership(Protocol):
    """Whether this replica runs the work done once (always with SQLite; the leader lock's holder on
    PostgreSQL)."""

    @property
    def leading(self) -> bool: ...


class Reservations(Protocol):
    """The locks a check and the change it allows are held under (a tenant's quota, a name unique in its scope),
    in this process and, with replicas, across all of them."""

    def reservation(self, *names: tuple[str, str]) -> AbstractAsyncContextManager[None]:
        """Hold the locks ``names`` (``("tenant", t)``, :meth:`name_lock`'s) around a check and its change."""

    def name_lock(self, kind: str, *scope: str) -> tuple[str, str]:
        """The lock of a name unique in its scope (``sandbox``, ``service``, ``volume``, ``org`` ...)."""


class NodeLookup(Protocol):
    """The node holding a record, answering (503 ``unavailable`` naming it when it is unknown or silent)."""

    def node_for(self, name: str, what: str) -> Node:
        """The node ``name``, healthy; ``what`` names the record in the error (``sandbox sbx_...``)."""


if TYPE_CHECKING:
    from sbx.gateway.server import Gateway

    def _gateway_provides_them(gw: Gateway) -> tuple[Writes, AuditSink, Leadership, Reservations, NodeLookup]:
        """Never run: mypy holds ``Gateway`` to every interface here, where they are all named."""
        return gw, gw, gw, gw, gw
