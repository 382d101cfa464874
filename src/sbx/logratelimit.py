"""Rate-limit log records that repeat, so that a hostile sandbox or client cannot fill the disk with them.

A :class:`RateLimitFilter` lets through at most ``burst`` records of one *kind* per ``interval_secs`` and
drops the rest, counting them. The last record let through before the drops carries ``rate_limited_secs``
(how long records like it are dropped from then on, at most), and the first one let through afterwards the
count in its ``suppressed`` field (the JSON log shows both like any ``extra``): nothing is hidden, only
summarised. A kind
is the logger, the message template (before ``%`` arguments are applied) and the record's ``sandbox`` field
when it has one: one sandbox flooding a message does not silence the same message about another sandbox.

Attach it to the loggers whose messages repeat once per connection, query or accept (a filter on a logger
sees the records created by that logger itself, not those of its children)::

    log = logging.getLogger(__name__)
    log.addFilter(RateLimitFilter())

Memory is bounded: at most :data:`MAX_KINDS` kinds are tracked; past that the oldest windows are forgotten.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

#: Records of one kind let through per window, by default.
DEFAULT_BURST: Final = 10
#: Length of a window, seconds, by default.
DEFAULT_INTERVAL_SECS: Final = 10.0
#: Kinds tracked at once; a filter forgets the oldest beyond this.
MAX_KINDS: Final = 4096

Kind = tuple[str, str, str]


@dataclass
class _Window:
    started: float
    passed: int = 0
    suppressed: int = 0


class RateLimitFilter(logging.Filter):
    """Let through at most ``burst`` records of one kind (see the module docstring) per ``interval_secs``;
    ``clock`` is a monotonic time in seconds (a parameter so tests need not wait)."""

    def __init__(
        self,
        burst: int = DEFAULT_BURST,
        interval_secs: float = DEFAULT_INTERVAL_SECS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if burst < 1 or interval_secs <= 0:
            raise ValueError("burst must be at least 1 and interval_secs positive")
        self.burst = burst
        self.interval_secs = interval_secs
        self.clock = clock
        self._windows: dict[Kind, _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, str(record.msg), str(getattr(record, "sandbox", "")))
        now = self.clock()
        window = self._windows.get(kind)
        if window is None or now - window.started >= self.interval_secs:
            suppressed = self._windows.pop(kind).suppressed if window is not None else 0
            if len(self._windows) >= MAX_KINDS:
                self._forget_oldest()
            window = self._windows[kind] = _Window(now)  # inserted last: the dict stays oldest first
            if suppressed:
                record.suppressed = suppressed
        if window.passed >= self.burst:
            window.suppressed += 1
            return False
        window.passed += 1
        if window.passed == self.burst:
            record.rate_limited_secs = round(self.interval_secs - (now - window.started), 3)
        return True

    def _forget_oldest(self) -> None:
        # Dicts keep insertion order and a renewed window is inserted anew: the first are the oldest.
        for kind in list(self._windows)[: MAX_KINDS // 4]:
            del self._windows[kind]
