"""The values the SDK hands out are the wire contract's own types (``sbx.api``), decoded by its one codec:
the same classes the servers answer with, so there is no second description of an answer to drift.

A malformed answer raises ``Internal`` (the server broke the contract, the caller did nothing wrong).
"""

from __future__ import annotations

from sbx.api.events import EventList
from sbx.api.files import DirEntry
from sbx.api.processes import OutputChunk, RunResult

#: A piece of a process's output: ``stream`` (``stdout`` or ``stderr``; a tty process has only stdout) and
#: ``data`` (bytes).
OutputEvent = OutputChunk

__all__ = ["DirEntry", "EventList", "OutputEvent", "RunResult"]
