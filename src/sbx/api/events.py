"""Wire types of audit events (spec: Sandbox audit event, Events)."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

#: One event: ``{time, type, sandbox, ...fields of its type}`` (the spec's table of node events); a gateway
#: audit entry likewise carries ``time``, ``kind``, ``type`` and the fields of its kind.
Event = dict[str, Any]


class EventList(msgspec.Struct):
    """``GET .../events``: oldest first, at most the newest 5000 (``truncated`` when there were more)."""

    events: list[Event]
    truncated: bool


class AuditEntries(msgspec.Struct):
    """``GET /v1/admin/audit``: oldest first; ``truncated`` (true) only when more matched than ``limit``."""

    entries: list[Event]
    truncated: bool | UnsetType = UNSET
