"""Stand-ins of the gateway's shared interfaces (``sbx.gateway.interfaces``) for the unit tests that build its
parts without a gateway: each records what it was asked, so a test checks what a part did through it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Writes:
    """``Writes``: store writes at once, on the loop (deterministic; the gateway's go to a thread), each recorded
    by the name of the store call."""

    calls: list[str] = field(default_factory=list)

    async def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.calls.append(fn.__name__)
        return fn(*args)


@dataclass
class Locks:
    """``Reservations`` that record what was held (``held``, each reservation's names) and what is held now
    (``holding``)."""

    held: list[tuple[tuple[str, str], ...]] = field(default_factory=list)
    holding: list[tuple[str, str]] = field(default_factory=list)

    @contextlib.asynccontextmanager
    async def reservation(self, *names: tuple[str, str]) -> AsyncIterator[None]:
        self.held.append(names)
        self.holding += names
        try:
            yield
        finally:
            del self.holding[len(self.holding) - len(names) :]

    def name_lock(self, kind: str, *scope: str) -> tuple[str, str]:
        return (kind, "/".join(scope))


@dataclass
class Audit:
    """``AuditSink``: the entries recorded, in order."""

    entries: list[dict[str, Any]] = field(default_factory=list)

    def record_audit(self, **fields: Any) -> None:
        self.entries.append(fields)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["type"] == kind]


@dataclass
class Leader:
    """``Leadership``, flipped by the test."""

    leading: bool = True


@dataclass
class Clock:
    """A ``Clock`` the test moves (``now``, seconds)."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now
