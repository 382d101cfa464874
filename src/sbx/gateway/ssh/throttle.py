"""How many credentials an SSH client may try: per connection, and per source address over time (docs/ssh.md,
"Failed logins").

- **Per connection**: at most ``max_auth_tries`` credentials (6, as OpenSSH's sshd ``MaxAuthTries``): each SSH key
  offered (for a user name: the same key for another name is another try) and each token counts, accepted or
  not, so a connection cannot test any number of public keys or sandbox names; the refusal that reaches the
  limit is answered with a disconnect, "Too many authentication failures", as sshd words it.
- **Per source**: each refused credential is a failure of its source address (an IPv4 address; for IPv6 its /64,
  as one host is commonly given a whole /64). Within ``window_secs`` (10 minutes), a source's first
  ``source_failures / 2`` failures are answered at once; each further one is answered late, 0.5 s, then twice as
  late each time up to :data:`MAX_DELAY_SECS`; at ``source_failures`` (20) the source is refused: its open
  connections are disconnected at their next try, and new ones at once, until fewer than ``source_failures`` of its
  failures are left in the window. An accepted credential is answered at once, whatever its source's count, and a
  source's failures never touch another's.

Memory is bounded: at most ``source_failures`` timestamps per source, and at most :data:`MAX_SOURCES` sources (the
one whose last failure is oldest is forgotten first).
"""

from __future__ import annotations

import ipaddress
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: Credentials one connection may try, by default (OpenSSH's MaxAuthTries).
DEFAULT_MAX_AUTH_TRIES = 6
#: Failed credentials from one source within the window before it is refused, by default.
DEFAULT_SOURCE_FAILURES = 20
#: Seconds a failure counts against its source, by default.
DEFAULT_WINDOW_SECS = 600.0
#: The first late refusal waits this long; each next one twice as long, up to MAX_DELAY_SECS.
FIRST_DELAY_SECS = 0.5
MAX_DELAY_SECS = 4.0
#: Sources remembered at most.
MAX_SOURCES = 65536


@dataclass(frozen=True)
class LoginLimits:
    """The limits above: ``max_auth_tries`` per connection; ``source_failures`` per source within
    ``window_secs`` (slowed from half of it)."""

    max_auth_tries: int = DEFAULT_MAX_AUTH_TRIES
    source_failures: int = DEFAULT_SOURCE_FAILURES
    window_secs: float = DEFAULT_WINDOW_SECS


def source_of(address: str) -> str:
    """The source an address counts for: an IPv4 address as it is (an IPv4-mapped IPv6 one too), an IPv6
    address as its /64; anything else as given."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class SourceThrottle:
    """Failures by source within the window, and what they mean for the next answer."""

    def __init__(self, limits: LoginLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        #: Each source's failure times, oldest first (the newest ``source_failures``); sources by last failure.
        self._failures: dict[str, deque[float]] = {}

    @property
    def slow_after(self) -> int:
        """Failures answered at once; the ones after are answered late."""
        return self.limits.source_failures // 2

    def _recent(self, source: str, now: float) -> deque[float] | None:
        times = self._failures.get(source)
        if times is None:
            return None
        while times and times[0] <= now - self.limits.window_secs:
            times.popleft()
        if not times:
            del self._failures[source]
            return None
        return times

    def refused_for(self, source: str) -> float:
        """Seconds ``source`` stays refused (0: it is not)."""
        now = self._clock()
        times = self._recent(source, now)
        if times is None or len(times) < self.limits.source_failures:
            return 0.0
        return times[0] + self.limits.window_secs - now

    def failed(self, source: str) -> float:
        """Count a failure of ``source``; the seconds to wait before answering it (0: at once)."""
        now = self._clock()
        times = self._recent(source, now)
        if times is None:
            times = deque(maxlen=self.limits.source_failures)
            while len(self._failures) >= MAX_SOURCES:
                del self._failures[next(iter(self._failures))]
        else:
            del self._failures[source]  # to the end: sources are kept in the order of their last failure
        self._failures[source] = times
        times.append(now)
        late = len(times) - self.slow_after
        if late <= 0:
            return 0.0
        return float(min(FIRST_DELAY_SECS * 2 ** (late - 1), MAX_DELAY_SECS))

    def refused_sources(self) -> int:
        """Sources refused now (for the metrics)."""
        return sum(1 for source in list(self._failures) if self.refused_for(source) > 0)
