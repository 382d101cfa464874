"""What TCP ports a guest listens on, read from its ``/proc/net/tcp`` and ``/proc/net/tcp6`` (gVisor's netstack
writes them as Linux does): the rows in state ``0A`` (LISTEN), on any address."""

from __future__ import annotations

from collections.abc import Iterable

#: The state column of a listening socket in /proc/net/tcp{,6}.
LISTEN_STATE = "0A"


def listening_ports(tables: Iterable[str]) -> list[int]:
    """The ports, ascending and each once, of the LISTEN rows of the ``/proc/net/tcp``-format ``tables``.
    Lines that are not rows (the header, a torn last line) are skipped."""
    ports: set[int] = set()
    for table in tables:
        for line in table.splitlines():
            fields = line.split()
            if len(fields) < 4 or fields[3] != LISTEN_STATE or ":" not in fields[1]:
                continue
            try:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
            except ValueError:
                continue
    return sorted(p for p in ports if 0 < p < 65536)
