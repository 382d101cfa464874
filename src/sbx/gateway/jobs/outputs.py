"""What the gateway keeps of each finished attempt, on its own disk (``--jobs-dir``, default ``jobs/`` beside the
state file, mode 0700): ``<job>/<n>/stdout`` and ``stderr`` (each the first 8 MiB of its stream) and
``<job>/<n>/files/<i>`` for ``keep.files[i]``. Written while the attempt runs (a follower that starts again
after a gateway restart rewrites them from the start), read by ``GET .../runs/{n}/output`` and ``.../files``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Final

from sbx.api.processes import OutputChunk

#: Bytes kept per stream (the spec's run output limit).
STREAM_CAP_BYTES: Final = 8 * 1024 * 1024


class Spool:
    """The output of one attempt as it comes: each stream cut at :data:`STREAM_CAP_BYTES`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.truncated = False
        self._files: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self.restart()

    def restart(self) -> None:
        """Start again from nothing (the output is followed again from its beginning)."""
        self.close()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stream in ("stdout", "stderr"):
            self._files[stream] = os.open(
                self.directory / stream, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
            )
            self._sizes[stream] = 0
        self.truncated = False

    def add(self, chunk: OutputChunk) -> None:
        room = STREAM_CAP_BYTES - self._sizes[chunk.stream]
        data = chunk.data[: max(0, room)]
        if len(data) < len(chunk.data):
            self.truncated = True
        if data:
            os.write(self._files[chunk.stream], data)
            self._sizes[chunk.stream] += len(data)

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


class Outputs:
    """The directory of kept outputs and files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def run_dir(self, job: str, n: int) -> Path:
        return self.root / job / str(n)

    def spool(self, job: str, n: int) -> Spool:
        return Spool(self.run_dir(job, n))

    def read_stream(self, job: str, n: int, stream: str) -> bytes:
        try:
            return (self.run_dir(job, n) / stream).read_bytes()[:STREAM_CAP_BYTES]
        except FileNotFoundError:
            return b""

    def file_path(self, job: str, n: int, index: int) -> Path:
        return self.run_dir(job, n) / "files" / str(index)

    def keep_file(self, job: str, n: int, index: int, data: bytes) -> None:
        path = self.file_path(job, n, index)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_bytes(data)

    def remove(self, job: str) -> None:
        shutil.rmtree(self.root / job, ignore_errors=True)
