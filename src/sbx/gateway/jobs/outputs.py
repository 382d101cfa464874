"""What the gateway keeps of each finished attempt, on its own disk (``--jobs-dir``, default ``jobs/`` beside the
state file, mode 0700): ``<job>/<n>/stdout`` and ``stderr`` (each the first 8 MiB of its stream) and
``<job>/<n>/files/<i>`` for ``keep.files[i]``. Written while the attempt runs (a follower that starts again
after a gateway restart rewrites them from the start), read by ``GET .../runs/{n}/output`` and ``.../files``.

On PostgreSQL (several replicas) the same, with the same caps, as chunk rows of the store's ``job_output`` table
(:class:`StoreOutputs`), so every replica answers alike (docs/jobs.md, docs/ha.md).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Final

from sbx.api.processes import OutputChunk
from sbx.gateway.store import Store

#: Bytes kept per stream (the spec's run output limit).
STREAM_CAP_BYTES: Final = 8 * 1024 * 1024
STREAMS: Final = ("stdout", "stderr")


class _Capped:
    """Each stream cut at :data:`STREAM_CAP_BYTES`: the arithmetic both spools share."""

    def __init__(self) -> None:
        self.truncated = False
        self._sizes: dict[str, int] = {}

    def _reset_caps(self) -> None:
        self._sizes = dict.fromkeys(STREAMS, 0)
        self.truncated = False

    def _keep(self, chunk: OutputChunk) -> bytes:
        """The part of ``chunk`` within its stream's cap (counted as kept); sets ``truncated`` when cut."""
        room = STREAM_CAP_BYTES - self._sizes[chunk.stream]
        data = chunk.data[: max(0, room)]
        if len(data) < len(chunk.data):
            self.truncated = True
        self._sizes[chunk.stream] += len(data)
        return data


class Spool(_Capped):
    """The output of one attempt as it comes: each stream cut at :data:`STREAM_CAP_BYTES`."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory
        self._files: dict[str, int] = {}
        self.restart()

    def restart(self) -> None:
        """Start again from nothing (the output is followed again from its beginning)."""
        self.close()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stream in STREAMS:
            self._files[stream] = os.open(
                self.directory / stream, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
            )
        self._reset_caps()

    def add(self, chunk: OutputChunk) -> None:
        data = self._keep(chunk)
        if data:
            os.write(self._files[chunk.stream], data)

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


class Outputs:
    """The directory of kept outputs and files."""

    def __init__(self, root: Path, create: bool = True) -> None:
        self.root = root
        if create:
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

    def read_file(self, job: str, n: int, index: int) -> bytes | None:
        """A kept file's bytes; None when it is not there."""
        try:
            return self.file_path(job, n, index).read_bytes()
        except FileNotFoundError:
            return None

    def keep_file(self, job: str, n: int, index: int, data: bytes) -> None:
        path = self.file_path(job, n, index)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_bytes(data)

    def remove(self, job: str) -> None:
        shutil.rmtree(self.root / job, ignore_errors=True)


#: The chunk rows of the store's ``job_output`` table hold at most this much.
CHUNK_BYTES: Final = 256 * 1024
#: A spool writes what it holds of a stream once it holds ``CHUNK_BYTES`` or this long after its last write.
SPOOL_FLUSH_SECS: Final = 1.0


class StoreSpool(_Capped):
    """:class:`Spool` into the store (PostgreSQL): each stream cut at :data:`STREAM_CAP_BYTES`, written in chunks
    of :data:`CHUNK_BYTES` as they fill (or a second after the last write), the rest at :meth:`close`."""

    def __init__(self, store: Store, job: str, n: int) -> None:
        super().__init__()
        self.store = store
        self.job = job
        self.n = n
        self._held: dict[str, bytearray] = {}
        self._seq: dict[str, int] = {}
        self._written_at = time.monotonic()
        self.restart()

    def restart(self) -> None:
        """Start again from nothing (the output is followed again from its beginning)."""
        self.store.output_clear(self.job, self.n, STREAMS)
        for stream in STREAMS:
            self._held[stream] = bytearray()
            self._seq[stream] = 0
        self._reset_caps()

    def add(self, chunk: OutputChunk) -> None:
        self._held[chunk.stream] += self._keep(chunk)
        if time.monotonic() - self._written_at >= SPOOL_FLUSH_SECS:
            self._write(everything=True)
        elif len(self._held[chunk.stream]) >= CHUNK_BYTES:
            self._write(everything=False)

    def _write(self, everything: bool) -> None:
        """Write each stream's full chunks (and, ``everything``, its last partial one: rewritten as it grows)."""
        for stream, held in self._held.items():
            while len(held) >= CHUNK_BYTES:
                self.store.output_put(self.job, self.n, stream, self._seq[stream], bytes(held[:CHUNK_BYTES]))
                del held[:CHUNK_BYTES]
                self._seq[stream] += 1
            if everything and held:
                self.store.output_put(self.job, self.n, stream, self._seq[stream], bytes(held))
        self._written_at = time.monotonic()

    def close(self) -> None:
        """Write what is held (the last partial chunk of each stream)."""
        self._write(everything=True)


class StoreOutputs:
    """:class:`Outputs` in the store: a run's streams and kept files as chunk rows of ``job_output`` (PostgreSQL:
    every replica reads what the leader's run kept). ``legacy``: the directory a gateway kept them in as files
    before (``--jobs-dir``), read when the store has nothing of a run (one moved by ``sandbox-gateway
    migrate``)."""

    def __init__(self, store: Store, legacy: Path | None = None) -> None:
        self.store = store
        self.legacy = Outputs(legacy, create=False) if legacy is not None else None

    def spool(self, job: str, n: int) -> StoreSpool:
        return StoreSpool(self.store, job, n)

    def read_stream(self, job: str, n: int, stream: str) -> bytes:
        data = self.store.output_read(job, n, stream)
        if data is None and self.legacy is not None:
            return self.legacy.read_stream(job, n, stream)
        return (data or b"")[:STREAM_CAP_BYTES]

    def read_file(self, job: str, n: int, index: int) -> bytes | None:
        data = self.store.output_read(job, n, f"file/{index}")
        if data is None and self.legacy is not None:
            return self.legacy.read_file(job, n, index)
        return data

    def stored_file(self, job: str, n: int, index: int) -> StoredFile | bytes | None:
        """A kept file to answer without holding it whole: its chunks in the store, read one at a time; the bytes
        of one kept as a file before (``legacy``); None when it is not there."""
        stream = f"file/{index}"
        sizes = self.store.output_chunk_sizes(job, n, stream)
        if sizes:
            return StoredFile(self.store, job, n, stream, sizes)
        return self.legacy.read_file(job, n, index) if self.legacy is not None else None

    def keep_file(self, job: str, n: int, index: int, data: bytes) -> None:
        chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
        self.store.output_replace(job, n, f"file/{index}", chunks)

    def remove(self, job: str) -> None:
        self.store.output_remove(job)
        if self.legacy is not None:
            self.legacy.remove(job)


class StoredFile:
    """A kept file in the store, read a chunk (``CHUNK_BYTES``) at a time, so answering it holds one chunk in memory
    and not the whole file (up to its 64 MiB cap)."""

    def __init__(self, store: Store, job: str, n: int, stream: str, sizes: list[tuple[int, int]]) -> None:
        self.store = store
        self.key = (job, n, stream)
        self.seqs = [seq for seq, _ in sizes]
        #: The file's length in bytes (its chunks' total when it was listed).
        self.size = sum(size for _, size in sizes)

    def chunk(self, i: int) -> bytes:
        """The ``i``-th chunk (blocking: call it through a thread). ``LookupError`` when it is gone (the job was
        removed while it was being answered)."""
        data = self.store.output_chunk(*self.key, self.seqs[i])
        if data is None:
            raise LookupError(f"chunk {self.seqs[i]} of {self.key} is gone")
        return data


#: What the jobs' controller keeps outputs with: files on the gateway's disk, or the store.
AnyOutputs = Outputs | StoreOutputs
