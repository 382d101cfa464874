"""The records of one sandbox's processes on disk: one append-only file of JSON lines, ``journal.ndjson``.

Each line is an entry about one process, keyed by ``pid``: its start (argv, start time, tty), later its exit
(code and time), and when the node forgets it, ``{"pid": N, "forgotten": true}``. Reading merges a process's
entries in order. One file per sandbox, not one per process: creating a file costs the host an inode
allocation, which on ext4 grew to most of sandboxd's CPU per run (issue 31: two files per ``run`` of ``true``,
about 1 ms), while an append to a file that exists is one ``open``, ``write`` and ``close`` (a few
microseconds, and no descriptor held per sandbox).

A line is written with one ``write``: a kill can cut only the last one, which reading drops. The file is
rewritten (atomically, :func:`sbx.statefile.write_bytes_atomic`) with one merged line per remembered process
once it holds :data:`COMPACT_FACTOR` times as many lines as that plus :data:`COMPACT_SLACK`, so its size stays
proportional to what the node remembers and each rewrite is paid for by as many appends as it writes lines.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import msgspec

from sbx.statefile import write_bytes_atomic

#: The file's name in the sandbox's ``processes/`` directory (never ``*.json``: those are the records of
#: sandboxd versions before the journal, read as well).
JOURNAL_NAME: Final = "journal.ndjson"
#: A rewrite is due once the file holds this many lines per remembered process ...
COMPACT_FACTOR: Final = 3
#: ... plus this many.
COMPACT_SLACK: Final = 256

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(dict[str, Any])


class ProcessJournal:
    """Appends entries about processes to ``path`` and reads them back merged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        #: Lines in the file (what the next rewrite is decided by); known after :meth:`read` or a rewrite.
        self.lines = 0

    def append(self, entry: dict[str, Any]) -> None:
        """Add one entry (it must carry ``pid``), creating the file at the first."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, _encoder.encode(entry) + b"\n")
        finally:
            os.close(fd)
        self.lines += 1

    def forgotten(self, pid: int) -> None:
        """Note that process ``pid`` is forgotten: reading no longer returns it."""
        self.append({"pid": pid, "forgotten": True})

    def read(self) -> dict[int, dict[str, Any]]:
        """Every process not forgotten, by pid in the order first written, its entries merged. A last line a
        kill cut is dropped from the file, so that the next append starts a line of its own."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self.lines = 0
            return {}
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            os.truncate(self.path, whole)
        merged: dict[int, dict[str, Any]] = {}
        lines = data[:whole].splitlines()
        for line in lines:
            try:
                entry = _decoder.decode(line)
                pid = int(entry.pop("pid"))
            except (msgspec.DecodeError, KeyError, TypeError, ValueError):
                continue  # not an entry (damaged): skipped, never guessed at
            if entry.get("forgotten"):
                merged.pop(pid, None)
            else:
                merged.setdefault(pid, {}).update(entry)
        self.lines = len(lines)
        return merged

    def due(self, remembered: int) -> bool:
        """Whether the file should be rewritten, ``remembered`` processes being all it must keep."""
        return self.lines > COMPACT_FACTOR * remembered + COMPACT_SLACK

    def rewrite(self, entries: Iterable[dict[str, Any]]) -> None:
        """Replace the file by one line per entry (each a whole process's record, with ``pid``)."""
        lines = [_encoder.encode(entry) + b"\n" for entry in entries]
        write_bytes_atomic(self.path, b"".join(lines), durable=False)
        self.lines = len(lines)
