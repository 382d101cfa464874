"""A sandbox as the egress proxy and resolver see it: address, current policy, live relays, and the addresses
the resolver gave it for each name (docs/network.md)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from sbx.api.network_policy import NetworkPolicy
from sbx.net.ranges import Kind
from sbx.net.rules import address_permitted, name_permitted

#: How long an address the resolver gave a sandbox for a name still counts as that name's, seconds (clients
#: cache answers; the upstream may have moved on meanwhile).
ANSWER_MEMORY_SECS: Final = 600.0
_MAX_NAMES: Final = 1024


@dataclass(eq=False)
class Relay:
    """One relayed connection: the name it was admitted under (None: nameless), the kind of address it goes
    to, its two sockets, and how to stop it: ``on_cut`` (stops the kernel relay) once relaying, else ``task``
    (the task serving it, whose cleanup resets the sockets once its pending socket waits are cancelled)."""

    name: str | None
    kind: Kind
    client: socket.socket
    upstream: socket.socket | None = None
    task: asyncio.Task[None] | None = None
    on_cut: Callable[[], None] | None = None

    def cut(self) -> None:
        """Reset both sides at once (idempotent)."""
        if self.on_cut is not None:
            self.on_cut()
        elif self.task is not None and not self.task.done() and self.task is not _current_task():
            # A socket wait may be registered with the event loop: cancel it first, then the task resets.
            self.task.cancel()
            return
        for sock in (self.client, self.upstream):
            if sock is not None:
                reset(sock)

    def close(self) -> None:
        """Close both sides normally (after both directions ended)."""
        if self.on_cut is not None:
            self.on_cut()
        for sock in (self.client, self.upstream):
            if sock is not None:
                sock.close()


def _current_task() -> asyncio.Task[object] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


@dataclass
class Attachment:
    """A sandbox as the proxy and the resolver see it: its address and current policy, and its relays."""

    sandbox_id: str
    address: ipaddress.IPv4Address
    policy: NetworkPolicy
    relays: set[Relay] = field(default_factory=set)
    #: name -> {address: when it was last given}, filled by the resolver.
    answered: dict[str, dict[ipaddress.IPv4Address, float]] = field(default_factory=dict)

    def remember(self, name: str, addresses: Iterable[ipaddress.IPv4Address]) -> None:
        """The resolver gave ``addresses`` for ``name`` to this sandbox."""
        if len(self.answered) >= _MAX_NAMES and name not in self.answered:
            self.answered.clear()
        now = time.monotonic()
        given = self.answered.setdefault(name, {})
        for address in addresses:
            given[address] = now

    def addresses_given(self, name: str) -> set[ipaddress.IPv4Address]:
        """The addresses given for ``name`` within ANSWER_MEMORY_SECS."""
        oldest = time.monotonic() - ANSWER_MEMORY_SECS
        return {a for a, at in self.answered.get(name, {}).items() if at >= oldest}

    def set_policy(self, policy: NetworkPolicy) -> int:
        """Apply ``policy`` from now on; cut the relays it does not permit. Returns how many were cut."""
        self.policy = policy
        cut = [r for r in self.relays if not still_permitted(policy, r)]
        for relay in cut:
            self.relays.discard(relay)
            relay.cut()
        return len(cut)


def still_permitted(policy: NetworkPolicy, relay: Relay) -> bool:
    if relay.name is not None and not name_permitted(policy, relay.name):
        return False
    return address_permitted(policy, relay.kind, named=relay.name is not None)


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a FIN: the peer learns at once that nothing is there."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass  # already closed
    sock.close()
