"""Caps on a resource that sandboxes hold: each sandbox at most ``per_sandbox``, all together at most ``total``.

Used for what one sandbox could otherwise take from the others on the host: the egress proxy's and the
resolver's connections (sbx.net.limits), attaches and tunnels (sbx.node.streams).
"""

from __future__ import annotations

import resource
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Slots:
    """How much of one resource each sandbox holds: :meth:`acquire` refuses beyond ``per_sandbox`` for one
    sandbox or ``total`` for all of them together; every acquired slot is given back with :meth:`release`."""

    per_sandbox: int
    total: int
    _held: Counter[str] = field(default_factory=Counter)
    _in_use: int = 0

    def acquire(self, sandbox_id: str) -> bool:
        """Take a slot for ``sandbox_id``; False (nothing taken) when either cap is reached."""
        if self._held[sandbox_id] >= self.per_sandbox or self._in_use >= self.total:
            return False
        self._held[sandbox_id] += 1
        self._in_use += 1
        return True

    def release(self, sandbox_id: str) -> None:
        """Give back a slot :meth:`acquire` gave ``sandbox_id``."""
        self._held[sandbox_id] -= 1
        if self._held[sandbox_id] <= 0:
            del self._held[sandbox_id]
        self._in_use -= 1

    def held(self, sandbox_id: str) -> int:
        """Slots ``sandbox_id`` holds now."""
        return self._held[sandbox_id]

    @property
    def in_use(self) -> int:
        """Slots held by all sandboxes together."""
        return self._in_use


def open_file_limit() -> int:
    """This process's soft limit on open files (RLIMIT_NOFILE), with "unlimited" read as 2**20."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft
