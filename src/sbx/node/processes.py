"""Processes of one sandbox: started through its agent, recorded on the host, followed by clients.

``pid`` is the server's handle (1, 2, ... per sandbox), never the guest kernel's. The records of a sandbox's
processes (argv, times, exit code) are lines of one journal, ``processes/journal.ndjson``
(sbx.node.process_journal), and each process that prints has an output log ``processes/<pid>.out``, so output
can be replayed from the start and survives a sandboxd restart. (sandboxd before the journal wrote a record
file ``<pid>.json`` per process; those are read too.)

What a request costs does not depend on how many processes the sandbox has had: the running and exited
processes are counted as they start and exit, and the oldest exited ones (forgotten past
MAX_EXITED_PROCESSES, or whose output is dropped first when the output budget is short) come off heaps of
pids, never from a sort or a scan of the table.

The logs of one sandbox share one :class:`~sbx.node.output_log.OutputBudget` (docs/node-api.md, "Processes"):
when it is used up, the output of exited processes is dropped first, oldest first, then new output is. When
the sandbox terminates, every log is cut down to its summary (exit code and byte counts): the records stay
listable while the node remembers the sandbox, the output goes.
"""

from __future__ import annotations

import asyncio
import heapq
import signal as signals
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from msgspec import UNSET

from sbx.agent.client import AgentClient, CommandNotFound, SpawnFailed
from sbx.api.errors import Conflict, Internal, InvalidRequest, NotFound
from sbx.api.processes import OutputChunk, OutputExit, Process, RunResult
from sbx.backends.base import GuestUser
from sbx.node.audit import AuditLog, process_started_fields
from sbx.node.output_log import OutputBudget, OutputLog
from sbx.node.process_journal import JOURNAL_NAME, ProcessJournal
from sbx.node.records import iso_utc, utc_now
from sbx.statefile import read_json

#: Run output kept per stream in the run result (spec: 8 MiB, then truncated).
RUN_OUTPUT_CAP_BYTES = 8 * 1024 * 1024
#: Exited processes remembered per sandbox; the oldest go first (with their output logs).
MAX_EXITED_PROCESSES = 1000
#: Exit code the spec gives a run that timed out.
TIMED_OUT_EXIT_CODE = -1

SIGNALS = {"INT": signals.SIGINT, "TERM": signals.SIGTERM, "KILL": signals.SIGKILL, "HUP": signals.SIGHUP}


def base_env(guest: GuestUser) -> dict[str, str]:
    """Environment every process starts with, below the image's, the sandbox's and the request's own."""
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": guest.home,
        "USER": guest.name,
        "LOGNAME": guest.name,
        "LANG": "C.UTF-8",
    }


@dataclass
class ProcessRecord:
    """One process as the API shows it (plus what the host needs to resume it)."""

    pid: int
    argv: list[str]
    started_at: str
    tty: bool = False
    exit_code: int | None = None
    finished_at: str | None = None

    def wire(self) -> Process:
        """The spec's Process object."""
        state: Literal["running", "exited"] = "running" if self.exit_code is None else "exited"
        return Process(self.pid, self.argv, state, self.exit_code, self.started_at)

    def entry(self) -> dict[str, object]:
        """The whole record as one journal entry."""
        return {"pid": self.pid, "argv": self.argv, "started_at": self.started_at, "tty": self.tty,
                "exit_code": self.exit_code, "finished_at": self.finished_at}  # fmt: skip

    @classmethod
    def from_entry(cls, pid: int, fields: dict[str, object]) -> ProcessRecord:
        """A record from its journal entries merged (or an old record file); fields it does not know are left."""
        known = {k: v for k, v in fields.items() if k in _RECORD_FIELDS}
        return cls(pid=pid, **known)  # type: ignore[arg-type]


_RECORD_FIELDS = frozenset(("argv", "started_at", "tty", "exit_code", "finished_at"))


class _Process:
    """Host side of one process: its record, output log and exit notification. ``meta_path``: its record file,
    for a process recorded by a sandboxd before the journal (None for the others)."""

    def __init__(self, record: ProcessRecord, log: OutputLog, meta_path: Path | None = None) -> None:
        self.record = record
        self.log = log
        self.meta_path = meta_path
        self.exited = asyncio.Event()
        self.started_monotonic = time.monotonic()
        self.capture: dict[str, bytearray] | None = None
        self.capture_truncated = False
        if record.exit_code is not None:
            self.exited.set()


class _Sink:
    """Receives a process's output and exit from the agent; the agent is acked after each call returns."""

    def __init__(self, table: ProcessTable, proc: _Process) -> None:
        self.table = table
        self.proc = proc

    async def on_output(self, stream: str, data: bytes) -> None:
        await self.proc.log.append(stream, data)
        capture = self.proc.capture
        if capture is not None:
            room = RUN_OUTPUT_CAP_BYTES - len(capture[stream])
            if len(data) > room:
                self.proc.capture_truncated = True
            capture[stream] += data[: max(room, 0)]

    async def on_exit(self, exit_code: int) -> None:
        await self.table._finish(self.proc, exit_code)


async def _awake() -> None:
    return None


class ProcessTable:
    """The processes of one sandbox, run as ``guest``. ``on_change`` is called when one starts or exits (for
    idle tracking); ``wake`` is awaited before every call to the agent (a parked sandbox is woken first)."""

    def __init__(
        self,
        sandbox_id: str,
        directory: Path,
        audit: AuditLog,
        guest: GuestUser,
        on_change: Callable[[], None] = lambda: None,
        wake: Callable[[], Awaitable[None]] = _awake,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.guest = guest
        self.directory = directory
        self.audit = audit
        self.on_change = on_change
        self.wake = wake
        self.agent: AgentClient | None = None
        #: Why there is no agent connection for a while ("being snapshotted"), None normally.
        self.paused_reason: str | None = None
        self._procs: dict[int, _Process] = {}
        self._next_pid = 1
        #: Processes running and exited, counted as they start, exit and are forgotten.
        self._running = 0
        self._exited = 0
        #: The pids of the exited processes, smallest (oldest) first: what is forgotten first. May hold pids
        #: already forgotten, skipped when they come up.
        self._exited_heap: list[int] = []
        self.journal = ProcessJournal(directory / JOURNAL_NAME)
        #: The output all this sandbox's logs may keep on the host.
        self.output_budget = OutputBudget(reclaim=self._reclaim_output)
        #: Exited processes whose logs still hold output (what a reclaim may drop), and their pids smallest
        #: first (may hold pids no longer in the set, skipped).
        self._reclaimable: set[int] = set()
        self._reclaim_heap: list[int] = []
        directory.mkdir(parents=True, exist_ok=True)

    # -- loading and resuming ---------------------------------------------------------------------------

    def load(self) -> None:
        """Read the records written before a restart (the journal, and the record files of a sandboxd before
        it); an exit the record lacks is read from the end of the output log."""
        found: dict[int, tuple[ProcessRecord, Path | None]] = {}
        for meta in self.directory.glob("*.json"):
            try:
                data = read_json(meta)
            except ValueError:
                # Cut by a kill in the microseconds between creating the file and writing it: the process
                # never got its spawn request, so there is nothing to take back.
                meta.unlink(missing_ok=True)
                continue
            if isinstance(data, dict) and isinstance(data.get("pid"), int):
                found[data["pid"]] = (ProcessRecord.from_entry(data["pid"], data), meta)
        for pid, fields in self.journal.read().items():
            found[pid] = (ProcessRecord.from_entry(pid, fields), found[pid][1] if pid in found else None)
        for pid in sorted(found):
            record, meta_path = found[pid]
            log = OutputLog(self.directory / f"{pid}.out", self.output_budget)
            if record.exit_code is None and log.exit_code is not None and log.exited_at is not None:
                record.exit_code = log.exit_code
                record.finished_at = iso_utc(log.exited_at)
            if record.exit_code is not None:
                log.ended()  # followers of a process that printed nothing (no log file) end at once
            self._procs[pid] = _Process(record, log, meta_path)
            self._next_pid = max(self._next_pid, pid + 1)
            if record.exit_code is None:
                self._running += 1
            else:
                self._exited += 1
                heapq.heappush(self._exited_heap, pid)
                if log.charged:
                    self._reclaimable_add(pid)

    async def attach_agent(self, agent: AgentClient) -> None:
        """Connect the processes the agent still knows to their records; those it lost end with -1."""
        self.agent = agent
        known = {p.handle: p for p in await agent.list_processes()}
        for handle in known:
            proc = self._procs.get(handle)
            if proc is None or proc.record.exit_code is not None:
                # Recorded (or forgotten) here, but its FORGET was lost with an earlier connection.
                agent.forget_later(handle)
        for pid, proc in list(self._procs.items()):
            if proc.record.exit_code is not None:
                continue
            if pid in known:
                await agent.set_process_sink(
                    pid, _Sink(self, proc), stdout_offset=proc.log.offsets["stdout"],
                    stderr_offset=proc.log.offsets["stderr"],
                )  # fmt: skip
            else:
                await self._finish(proc, TIMED_OUT_EXIT_CODE)

    # -- queries ----------------------------------------------------------------------------------------

    def records(self) -> list[ProcessRecord]:
        """Every remembered process, oldest first."""
        return [p.record for p in sorted(self._procs.values(), key=lambda p: p.record.pid)]

    def get(self, pid: int) -> _Process:
        """The process with handle ``pid``; NotFound otherwise."""
        proc = self._procs.get(pid)
        if proc is None:
            raise NotFound(f"no process {pid} in sandbox {self.sandbox_id}")
        return proc

    @property
    def next_pid(self) -> int:
        """The handle the next process will get."""
        return self._next_pid

    @property
    def running(self) -> int:
        """How many processes are running (a count kept as they start and exit: O(1))."""
        return self._running

    # -- starting ---------------------------------------------------------------------------------------

    async def start(
        self,
        argv: list[str],
        env: dict[str, str],
        request_env_names: list[str],
        cwd: str | None,
        tty: tuple[int, int] | None = None,
        capture: bool = False,
        stdin: bytes = b"",
        close_stdin: bool = False,
    ) -> _Process:
        """Spawn ``argv`` in the sandbox; a missing command is InvalidRequest and leaves no record.

        ``stdin`` is sent right behind the spawn (and ``close_stdin`` ends the input), saving round trips.
        """
        await self.wake()
        agent = self.require_agent()
        pid = self._next_pid
        self._next_pid += 1
        record = ProcessRecord(pid=pid, argv=list(argv), started_at=utc_now(), tty=tty is not None)
        proc = _Process(record, OutputLog(self.directory / f"{pid}.out", self.output_budget, new=True))
        if capture:
            proc.capture = {"stdout": bytearray(), "stderr": bytearray()}
        self._procs[pid] = proc
        self._running += 1
        # Before the spawn: a sandboxd killed right after it finds the record and takes the process back.
        self.journal.append(
            {"pid": pid, "argv": record.argv, "started_at": record.started_at, "tty": record.tty}
        )
        try:
            await agent.spawn(
                pid, argv, env, cwd or self.guest.home, self.guest.uid, self.guest.gid, tty=tty,
                sink=_Sink(self, proc),
                stdin=stdin, close_stdin=close_stdin,
            )  # fmt: skip
        except CommandNotFound as exc:
            self._discard(proc)
            raise InvalidRequest(f"command not found: {argv[0]} ({exc})") from None
        except SpawnFailed as exc:
            self._discard(proc)
            raise InvalidRequest(f"cannot start {argv[0]}: {exc}") from None
        self.audit.record(
            "process.started", self.sandbox_id,
            **process_started_fields(pid, argv, cwd or self.guest.home, request_env_names),
        )  # fmt: skip
        self.on_change()
        self._forget_old()
        return proc

    def _discard(self, proc: _Process) -> None:
        pid = proc.record.pid
        if self._procs.pop(pid, None) is not None:
            if proc.record.exit_code is None:
                self._running -= 1
            else:
                self._exited -= 1
        self.journal.forgotten(pid)
        if proc.meta_path is not None:
            proc.meta_path.unlink(missing_ok=True)
        proc.log.remove()
        self._reclaimable.discard(pid)

    async def _finish(self, proc: _Process, exit_code: int) -> None:
        if proc.record.exit_code is not None:
            return
        exited_at = time.time()
        pid = proc.record.pid
        proc.record.exit_code = exit_code
        proc.record.finished_at = iso_utc(exited_at)
        self._running -= 1
        self._exited += 1
        heapq.heappush(self._exited_heap, pid)
        self.journal.append({"pid": pid, "exit_code": exit_code, "finished_at": proc.record.finished_at})
        await proc.log.finish(exit_code, exited_at)
        if proc.log.charged:
            self._reclaimable_add(pid)
        proc.exited.set()
        duration_ms = int((time.monotonic() - proc.started_monotonic) * 1000)
        self.audit.record(
            "process.exited",
            self.sandbox_id,
            pid=proc.record.pid,
            exit_code=exit_code,
            duration_ms=duration_ms,
        )
        if self.agent is not None:
            # Recorded whole here: the agent may drop it. Sent with the next frames, not on its own (its own
            # write would wake the guest, its reply sandboxd, once more per process).
            self.agent.forget_later(pid)
        self.on_change()

    def _forget_old(self) -> None:
        """Forget the oldest exited processes past MAX_EXITED_PROCESSES (one per start, in the steady state),
        and rewrite the journal when it is due; O(log n) per process forgotten."""
        while self._exited > MAX_EXITED_PROCESSES and self._exited_heap:
            proc = self._procs.get(heapq.heappop(self._exited_heap))
            if proc is not None and proc.record.exit_code is not None:
                self._discard(proc)
        if self.journal.due(len(self._procs)):
            self.journal.rewrite(p.record.entry() for p in self._procs.values())

    # -- run ------------------------------------------------------------------------------------------

    async def run(
        self,
        argv: list[str],
        env: dict[str, str],
        request_env_names: list[str],
        cwd: str | None,
        stdin: bytes | None,
        timeout_secs: float | None,
    ) -> RunResult:
        """Run to completion; output capped per stream; on timeout the process group is killed."""
        proc = await self.start(
            argv, env, request_env_names, cwd, capture=True, stdin=stdin or b"", close_stdin=True
        )
        pid = proc.record.pid
        agent = self.require_agent()
        timed_out = False
        try:
            await asyncio.wait_for(proc.exited.wait(), timeout_secs)
        except TimeoutError:
            timed_out = True
            await agent.signal(pid, signals.SIGKILL)
            await proc.exited.wait()
        assert proc.capture is not None and proc.record.exit_code is not None
        return RunResult(
            exit_code=TIMED_OUT_EXIT_CODE if timed_out else proc.record.exit_code,
            stdout=bytes(proc.capture["stdout"]),
            stderr=bytes(proc.capture["stderr"]),
            truncated=proc.capture_truncated,
            timed_out=timed_out,
        )

    # -- interaction ------------------------------------------------------------------------------------

    async def write_stdin(self, pid: int, chunks: AsyncIterator[bytes], close: bool) -> int:
        """Send the chunks to the process's stdin, optionally closing it after; returns bytes sent."""
        proc = self._require_running(pid)
        await self.wake()
        agent = self.require_agent()
        sent = 0
        async for chunk in chunks:
            if proc.record.exit_code is not None:
                raise Conflict(f"process {pid} has exited; its stdin is closed")
            await agent.write_stdin(pid, chunk)
            sent += len(chunk)
        if close:
            await agent.close_stdin(pid)
        return sent

    async def send_stdin(self, pid: int, data: bytes) -> None:
        """Send ``data`` to the process's stdin without closing it."""
        self._require_running(pid)
        await self.wake()
        await self.require_agent().write_stdin(pid, data)

    async def close_stdin(self, pid: int) -> None:
        """Close the process's stdin (a terminal gets ^D)."""
        self._require_running(pid)
        await self.wake()
        await self.require_agent().close_stdin(pid)

    async def resize(self, pid: int, rows: int, cols: int) -> None:
        """Resize a terminal process's window; InvalidRequest for one without a terminal."""
        proc = self._require_running(pid)
        if not proc.record.tty:
            raise InvalidRequest(f"process {pid} has no terminal to resize")
        await self.wake()
        await self.require_agent().resize(pid, rows, cols)

    async def signal(self, pid: int, signum: int) -> None:
        """Deliver ``signum`` to the process's group."""
        self._require_running(pid)
        await self.wake()
        await self.require_agent().signal(pid, signum)

    async def follow(self, pid: int) -> AsyncIterator[OutputChunk | OutputExit]:
        """Output events from the start, then the exit (``truncated`` if output was dropped)."""
        proc = self.get(pid)
        async for stream, data in proc.log.follow():
            yield OutputChunk("stdout" if stream == "stdout" else "stderr", data)
        await proc.exited.wait()
        assert proc.record.exit_code is not None
        yield OutputExit(proc.record.exit_code, True if proc.log.truncated else UNSET)

    async def kill_all(self, drop_output: bool = True) -> None:
        """Mark every running process as ended (exit code -1) and, with ``drop_output``, drop all output kept on
        the host (the sandbox is going away; the records and their exit codes stay). Without it (a persistent
        sandbox stopping) every record and its output stay readable."""
        for proc in list(self._procs.values()):
            if proc.record.exit_code is None:
                await self._finish(proc, TIMED_OUT_EXIT_CODE)
        if not drop_output:
            return
        for proc in self._procs.values():
            proc.log.drop_output()
        self._reclaimable.clear()
        self._reclaim_heap.clear()

    def _reclaimable_add(self, pid: int) -> None:
        self._reclaimable.add(pid)
        heapq.heappush(self._reclaim_heap, pid)

    def _reclaim_output(self, needed: int) -> int:
        """Make room for ``needed`` bytes of output by dropping that of exited processes, oldest first;
        returns the bytes freed (less than ``needed`` when there is not enough). O(log n) per log dropped."""
        freed = 0
        while freed < needed and self._reclaim_heap:
            pid = heapq.heappop(self._reclaim_heap)
            if pid not in self._reclaimable:
                continue  # forgotten meanwhile
            self._reclaimable.discard(pid)
            freed += self._procs[pid].log.drop_output()
        return freed

    def _require_running(self, pid: int) -> _Process:
        proc = self.get(pid)
        if proc.record.exit_code is not None:
            raise Conflict(f"process {pid} has exited with code {proc.record.exit_code}")
        return proc

    def require_agent(self) -> AgentClient:
        if self.agent is None or self.agent.closed.is_set():
            if self.paused_reason is not None:
                raise Conflict(
                    f"sandbox {self.sandbox_id} is {self.paused_reason}; retry in a moment, when that is done"
                )
            raise Internal(f"the agent of sandbox {self.sandbox_id} is not connected")
        return self.agent
