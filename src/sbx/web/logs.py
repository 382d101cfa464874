"""Structured logs: one JSON object per line on stderr, with the ``extra`` fields a call passed.

Callers pass ids, paths and counts in ``extra``; never env values, file contents or process arguments.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from sbx.logratelimit import RateLimitFilter

_ASYNCIO_LIMIT = RateLimitFilter()
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Formats a record as ``{"time", "level", "logger", "msg", ...extra}``."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "info") -> None:
    """Send every log record to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # asyncio logs a failed accept (out of descriptors, ...) with a traceback at every try.
    logging.getLogger("asyncio").addFilter(_ASYNCIO_LIMIT)
