"""Caps on long-lived streams, attaches and tunnels, per sandbox and for the node (docs/node-api.md).

Each open stream holds host file descriptors and memory of sandboxd, the process that also answers every
other sandbox's calls; without a cap one sandbox's clients could take them all. A stream holds its slot from
before the protocol switch until it ends; one more than a cap is refused with 503 ``unavailable`` before
anything changes, and the client may retry when one has closed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from sbx.api.errors import Unavailable
from sbx.slots import Slots, open_file_limit

#: Attaches open at once per sandbox, all its processes together.
MAX_ATTACHES: Final = 64
#: Tunnels open at once per sandbox; 128 leaves room for a browser's parallel connections to a dev server.
MAX_TUNNELS: Final = 128
#: Descriptors an attach holds: the client's socket and a reader of the output log.
ATTACH_DESCRIPTORS: Final = 2
#: Descriptors a tunnel holds on the host: the client's socket (the guest side is a channel of the agent's
#: connection, whose buffers the agent's flow control bounds).
TUNNEL_DESCRIPTORS: Final = 1
#: Share of the open-file limit attaches and tunnels may hold together (egress holds 0.6, sbx.net.limits).
STREAMS_SHARE: Final = 0.2


@dataclass(frozen=True)
class StreamLimits:
    """The node's attach and tunnel slots."""

    attaches: Slots
    tunnels: Slots

    @classmethod
    def for_descriptors(cls, open_files: int | None = None) -> StreamLimits:
        """Per-sandbox caps MAX_ATTACHES and MAX_TUNNELS; totals that hold at most STREAMS_SHARE of
        ``open_files`` (default: this process's soft limit, read now), half each, at most 4096 each."""
        budget = int((open_file_limit() if open_files is None else open_files) * STREAMS_SHARE) // 2
        attaches = max(1, min(4096, budget // ATTACH_DESCRIPTORS))
        tunnels = max(1, min(4096, budget // TUNNEL_DESCRIPTORS))
        return cls(Slots(min(MAX_ATTACHES, attaches), attaches), Slots(min(MAX_TUNNELS, tunnels), tunnels))


@contextmanager
def holding(slots: Slots, sandbox_id: str, what: str) -> Iterator[None]:
    """Hold one of ``slots`` for ``sandbox_id`` during the ``with`` block; Unavailable (503) naming ``what``
    ("tunnels") and the cap reached when none is free, having taken nothing."""
    if not slots.acquire(sandbox_id):
        if slots.held(sandbox_id) >= slots.per_sandbox:
            raise Unavailable(f"{slots.per_sandbox} {what} are open in this sandbox; close one and retry")
        raise Unavailable(f"this node has {slots.total} {what} open, its limit; retry when one has closed")
    try:
        yield
    finally:
        slots.release(sandbox_id)
