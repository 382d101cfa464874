"""Connections that reach public services without a key: at most ``per_service`` for one service and ``total``
for all of them together (``--max-public-connections-per-service``, ``--max-public-connections``;
docs/services.md, "Connections without a key").

A TCP connection that has not authenticated counts against the server's ``--max-unauthenticated`` until its
first request to a public service; from then on it counts here, for that service (a request to another public
service moves it; a request with a valid key takes it out of every count, as on the API). So a client without a
key holds at most these many descriptors through public services, whatever it sends, and one public service's
crowd cannot take every place of another's.

At a cap, a newcomer takes the place of the connection that has waited longest for its next request, among
that service's (the per-service cap) or any service's (the gateway-wide cap): it is closed between two requests,
as the idle timeout closes a keep-alive connection, so its client opens a new one for its next request. When
every such connection has a request in progress, the newcomer's request is answered 503 ``unavailable`` with
``Connection: close`` and ``Retry-After``. A connection being answered is never closed to make room.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from sbx.web.connections import GatedRequestHandler

#: Connections without a key to one public service, at most, by default.
DEFAULT_MAX_PER_SERVICE = 256
#: Connections without a key to public services, all together, at most, by default.
DEFAULT_MAX_TOTAL = 1024


class PublicConnections:
    """The connections counted against the public services' caps, least recently used first."""

    def __init__(self, per_service: int = DEFAULT_MAX_PER_SERVICE, total: int = DEFAULT_MAX_TOTAL) -> None:
        self.per_service = per_service
        self.total = total
        #: Each connection and the service it last asked, least recently used first (a dict keeps order).
        self._members: dict[GatedRequestHandler, str] = {}
        self._per: Counter[str] = Counter()
        #: Connections closed to make room, and requests refused because none could be (for the metrics).
        self.closed_idle = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._members)

    def held(self, service_id: str) -> int:
        """Connections counted for ``service_id`` now."""
        return self._per[service_id]

    def admit(self, conn: GatedRequestHandler, service_id: str, cap: int | None = None) -> bool:
        """Count ``conn`` for ``service_id`` (a service's id, or a sandbox's for its public ports, whose ``cap``
        replaces ``per_service``), making room if a cap is reached; False when no room can be made (every
        connection in the way has a request in progress): the caller refuses the request."""
        current = self._members.get(conn)
        if current == service_id:
            del self._members[conn]  # to the end: the most recently used
            self._members[conn] = service_id
            return True
        while self._per[service_id] >= (self.per_service if cap is None else cap):
            if not self._close_oldest_idle(lambda s: s == service_id):
                self.refused += 1
                return False
        if current is None:
            while len(self._members) >= self.total:
                if not self._close_oldest_idle(lambda s: True):
                    self.refused += 1
                    return False
            conn.hold(lambda: self._drop(conn))
        else:
            self._drop(conn)  # moves from another service: the total does not change
        self._members[conn] = service_id
        self._per[service_id] += 1
        return True

    def _close_oldest_idle(self, chosen: Callable[[str], bool]) -> bool:
        for conn, service_id in self._members.items():
            if not chosen(service_id):
                continue
            if conn.transport is None:  # closed already; its connection_lost has not run yet
                self._drop(conn)
                return True
            if conn.idle():
                self._drop(conn)
                conn.close_idle()
                self.closed_idle += 1
                return True
        return False

    def _drop(self, conn: GatedRequestHandler) -> None:
        service_id = self._members.pop(conn, None)
        if service_id is not None:
            self._per[service_id] -= 1
            if self._per[service_id] <= 0:
                del self._per[service_id]
