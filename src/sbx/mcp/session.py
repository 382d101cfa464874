"""One MCP session: the SDK client it drives sandboxes with, what it made, the processes it follows, the end.

A session is one run of ``sandbox-cli mcp`` (one host connection over stdio; everyone connected to one
streamable HTTP server shares it). It has a random id; every sandbox it creates or forks carries the label
``mcp.session=<id>`` and the session's idle timeout, so its sandboxes can be listed (``list_sandboxes``) and
are reaped by the server even if the session dies without cleaning up. When the session ends it terminates
its sandboxes and deletes the snapshots it took, unless started with ``--keep`` (docs/mcp.md); a persistent
sandbox is never terminated then (it was asked for to outlive the session), only by ``terminate_sandbox``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from msgspec import UNSET

from sbx.api.codec import to_builtins
from sbx.api.errors import Internal, InvalidRequest, NotFound, SandboxError
from sbx.api.sandboxes import Sandbox as SandboxInfo
from sbx.api.snapshots import Snapshot
from sbx.client import AsyncClient, Endpoint, Process, Sandbox
from sbx.client._transport import AiohttpTransport
from sbx.mcp import tools as t
from sbx.mcp.output import (
    DEFAULT_MAX_OUTPUT_BYTES,
    StreamWindow,
    as_text,
    head_and_tail,
    page,
)

log = logging.getLogger(__name__)

#: The server's cut of each stream of a run, in bytes (spec: Limits, "Run output per stream").
RUN_OUTPUT_LIMIT_BYTES = 8 * 1024 * 1024
#: Default idle timeout of a session's sandboxes, in seconds (``--idle-timeout``).
DEFAULT_IDLE_TIMEOUT_SECS = 900
#: Background processes whose output one session follows at a time; the oldest finished ones go first.
MAX_FOLLOWED = 64
#: Sandbox handles a session keeps (by id), the oldest dropped first.
MAX_HANDLES = 256
#: Seconds a first read of a process this session did not start waits for its output to be replayed.
REPLAY_WAIT_SECS = 2.0


@dataclass(frozen=True)
class SessionConfig:
    """How a session behaves: where the server is, the idle timeout its sandboxes get (seconds; 0 leaves it
    to the server), the cap of each text field of an answer (bytes), and whether to keep what it made."""

    endpoint: Endpoint
    idle_timeout_secs: int = DEFAULT_IDLE_TIMEOUT_SECS
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    keep: bool = False


class Follower:
    """Follows one background process's output (replayed from its start) into two windows."""

    def __init__(self, proc: Process) -> None:
        self.proc = proc
        self.stdout = StreamWindow()
        self.stderr = StreamWindow()
        self.exit_code: int | None = None
        self.error: SandboxError | None = None
        self.done = asyncio.Event()
        #: Where this session's last read of each stream stopped (the default offsets of the next read).
        self.stdout_cursor = 0
        self.stderr_cursor = 0
        self.task = asyncio.create_task(self._follow(), name=f"mcp-follow-{proc.sandbox_id}-{proc.pid}")

    async def _follow(self) -> None:
        try:
            async for chunk in self.proc.output():
                (self.stdout if chunk.stream == "stdout" else self.stderr).append(chunk.data)
            self.exit_code = self.proc.exit_code
        except SandboxError as exc:
            self.error = exc
        except Exception as exc:  # a bug here must not end the session; the next read reports it
            log.exception("following a process failed", extra={"sandbox": self.proc.sandbox_id})
            self.error = Internal(f"following the process failed: {exc!r}")
        finally:
            self.done.set()

    async def wait(self, secs: float) -> None:
        """Until the process exits (or the stream fails), at most ``secs`` seconds."""
        if secs > 0 and not self.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), secs)

    async def stop(self) -> None:
        """Stop following (the process itself keeps running)."""
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class Session:
    """The state of one MCP session and the implementation of every tool (one method per tool name)."""

    def __init__(self, config: SessionConfig, client: AsyncClient | None = None) -> None:
        self.config = config
        self.id = secrets.token_hex(6)
        self.client = client or AsyncClient(transport=AiohttpTransport(config.endpoint))
        self.sandboxes: set[str] = set()
        #: The persistent ones among ``sandboxes``: the end of the session leaves them.
        self.persistent: set[str] = set()
        self.snapshots: set[str] = set()
        self.followers: OrderedDict[tuple[str, int], Follower] = OrderedDict()
        self._handles: OrderedDict[str, Sandbox] = OrderedDict()
        self._idle_secs: int | None | msgspec.UnsetType = UNSET

    # -- the end -------------------------------------------------------------------------------------------

    async def close(self) -> None:
        """End the session: stop following, and (unless ``keep``) terminate its sandboxes (those it knows of
        and any carrying its label) but the persistent ones, and delete its snapshots, all at once; then close
        the client. Failures are logged, never raised: the idle timeout reaps what could not be removed."""
        for follower in list(self.followers.values()):
            await follower.stop()
        self.followers.clear()
        try:
            if not self.config.keep:
                await self._remove_everything()
        finally:
            await self.client.aclose()

    async def _remove_everything(self) -> None:
        known = set(self.sandboxes)
        # What this session made persistent, and what the server says is: persistent can only be set at
        # create, so either one knowing it is enough to leave the sandbox alone.
        kept = set(self.persistent)
        try:
            labelled = await self.client.sandboxes.list(labels={t.SESSION_LABEL: self.id})
            known |= {s.id for s in labelled if s.state != "terminated"}
            kept |= {s.id for s in labelled if s.persistent}
        except SandboxError as exc:
            log.warning(
                "listing the session's sandboxes failed", extra={"code": exc.code, "error": exc.message}
            )
        ids = sorted(known - kept)
        results = await asyncio.gather(
            *(self.client.sandboxes.delete(i) for i in ids), return_exceptions=True
        )
        for sandbox_id, result in zip(ids, results, strict=True):
            if isinstance(result, BaseException):
                log.warning(
                    "terminating a sandbox at the end failed",
                    extra={"sandbox": sandbox_id, "error": str(result)},
                )
        snaps = list(self.snapshots)
        results = await asyncio.gather(
            *(self.client.snapshots.delete(i) for i in snaps), return_exceptions=True
        )
        for snapshot_id, result in zip(snaps, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, NotFound):
                log.warning(
                    "deleting a snapshot at the end failed",
                    extra={"snapshot": snapshot_id, "error": str(result)},
                )
        log.info(
            "session ended",
            extra={
                "session": self.id,
                "sandboxes": len(ids),
                "kept": len(kept & known),
                "snapshots": len(snaps),
            },
        )

    # -- sandboxes -----------------------------------------------------------------------------------------

    async def _sandbox(self, ref: str) -> Sandbox:
        """The SDK's handle of sandbox ``ref`` (an id or a name). A handle asked for by id is kept (an id never
        names another sandbox), so a call on it costs one request instead of two; a name is looked up every
        time (it may move to another sandbox). A kept handle of a sandbox that has gone gets the server's own
        answer to the call (``conflict`` or ``not_found``), as a lookup would."""
        held = self._handles.get(ref)
        if held is not None:
            return held
        sandbox = await self.client.sandboxes.get(ref)
        if ref == sandbox.id:
            self._hold(sandbox)
        return sandbox

    def _hold(self, sandbox: Sandbox) -> None:
        """Keep ``sandbox``'s handle (at most MAX_HANDLES, the oldest dropped first)."""
        self._handles[sandbox.id] = sandbox
        while len(self._handles) > MAX_HANDLES:
            self._handles.popitem(last=False)

    def summary(self, info: SandboxInfo) -> t.SandboxSummary:
        """A sandbox as the tools show it."""
        return t.SandboxSummary(
            id=info.id, name=info.name, state=info.state, image=info.image, cpus=info.cpus,
            memory_mb=info.memory_mb, disk_mb=info.disk_mb, network=to_builtins(info.network),
            labels=dict(info.labels), idle_timeout_secs=info.idle_timeout_secs, created_at=info.created_at,
            this_session=info.labels.get(t.SESSION_LABEL) == self.id, persistent=info.persistent,
            stopped_reason=info.stopped_reason,
        )  # fmt: skip

    async def _idle_timeout(self) -> int | None:
        """The session's idle timeout within the server's limit (asked once)."""
        if isinstance(self._idle_secs, msgspec.UnsetType):
            limit = 0
            if self.config.idle_timeout_secs > 0:
                limit = (await self.client.capabilities()).limits.max_idle_timeout_secs
            self._idle_secs = t.session_idle_timeout(self.config.idle_timeout_secs, limit)
        return self._idle_secs

    async def _create(self, args: t.CreateSandboxArgs | t.ForkSandboxArgs) -> t.SandboxSummary:
        fields = t.create_fields(args, self.id, await self._idle_timeout())
        sandbox = await self.client.sandboxes.create(**fields)
        self.sandboxes.add(sandbox.id)
        if sandbox.persistent:
            self.persistent.add(sandbox.id)
        self._hold(sandbox)
        return self.summary(sandbox.info)

    async def create_sandbox(self, args: t.CreateSandboxArgs) -> t.SandboxSummary:
        return await self._create(args)

    async def fork_sandbox(self, args: t.ForkSandboxArgs) -> t.SandboxSummary:
        return await self._create(args)

    async def list_sandboxes(self, args: t.ListSandboxesArgs) -> t.SandboxList:
        labels = dict(args.labels) if args.labels is not UNSET else {}
        if args.scope == "session":
            labels[t.SESSION_LABEL] = self.id
        found = [s.info for s in await self.client.sandboxes.list(labels=labels)]
        if not args.include_terminated:
            found = [info for info in found if info.state != "terminated"]
        shown = found[: t.MAX_LISTED_SANDBOXES]
        return t.SandboxList(
            sandboxes=[self.summary(info) for info in shown],
            total=len(found),
            truncated=len(shown) < len(found),
        )

    async def terminate_sandbox(self, args: t.SandboxArgs) -> t.Terminated:
        sandbox_id = (await self._sandbox(args.sandbox)).id
        await self.client.sandboxes.delete(sandbox_id)
        for key in [k for k in self.followers if k[0] == sandbox_id]:
            await self.followers.pop(key).stop()
        self.sandboxes.discard(sandbox_id)
        self.persistent.discard(sandbox_id)
        self._handles.pop(sandbox_id, None)
        return t.Terminated(sandbox=args.sandbox, terminated=True)

    # -- commands and processes ----------------------------------------------------------------------------

    async def run_command(self, args: t.RunCommandArgs) -> t.RunCommandResult:
        argv = t.command_argv(args.command, args.argv)
        limit = t.output_limit(args.max_output_bytes, self.config.max_output_bytes)
        sandbox = await self._sandbox(args.sandbox)
        result = await sandbox.run(
            argv,
            env=args.env if args.env is not UNSET else None,
            cwd=args.cwd if args.cwd is not UNSET else None,
            stdin=args.stdin.encode("utf-8") if args.stdin is not UNSET else None,
            timeout_secs=args.timeout_secs,
        )
        out = head_and_tail(result.stdout, limit)
        err = head_and_tail(result.stderr, limit)
        # The server has one flag for both streams: a stream it cut is one that reached its limit.
        cut_out = result.truncated and len(result.stdout) >= RUN_OUTPUT_LIMIT_BYTES
        cut_err = result.truncated and len(result.stderr) >= RUN_OUTPUT_LIMIT_BYTES
        return t.RunCommandResult(
            exit_code=result.exit_code, timed_out=result.timed_out, stdout=out.text, stderr=err.text,
            stdout_truncated=out.truncated or cut_out, stderr_truncated=err.truncated or cut_err,
            stdout_bytes=len(result.stdout), stderr_bytes=len(result.stderr),
        )  # fmt: skip

    async def start_process(self, args: t.StartProcessArgs) -> t.ProcessStarted:
        argv = t.command_argv(args.command, args.argv)
        sandbox = await self._sandbox(args.sandbox)
        proc = await sandbox.start_process(
            argv,
            env=args.env if args.env is not UNSET else None,
            cwd=args.cwd if args.cwd is not UNSET else None,
            stdin=args.stdin.encode("utf-8") if args.stdin is not UNSET else None,
        )
        await self._follow(proc)
        return t.ProcessStarted(sandbox=sandbox.id, pid=proc.pid, argv=proc.argv, state=proc.state)

    async def _follow(self, proc: Process) -> Follower:
        key = (proc.sandbox_id, proc.pid)
        follower = Follower(proc)
        self.followers[key] = follower
        while len(self.followers) > MAX_FOLLOWED:
            finished = [k for k, f in self.followers.items() if f.done.is_set() and k != key]
            victim = finished[0] if finished else next(iter(self.followers))
            await self.followers.pop(victim).stop()
        return follower

    async def _follower(self, ref: str, pid: int) -> Follower:
        """The follower of process ``pid``, started (and given time to replay) if this session has none."""
        sandbox = await self._sandbox(ref)
        key = (sandbox.id, pid)
        follower = self.followers.get(key)
        if follower is not None and follower.error is not None:
            # The stream broke (the server restarted, the sandbox went away): report it once, then start over.
            del self.followers[key]
            raise follower.error
        if follower is None:
            follower = await self._follow(await sandbox.get_process(pid))
            await follower.wait(REPLAY_WAIT_SECS)
        return follower

    async def read_process_output(self, args: t.ReadProcessOutputArgs) -> t.ProcessOutput:
        follower = await self._follower(args.sandbox, args.pid)
        await follower.wait(args.wait_secs)
        if follower.error is not None:
            raise follower.error
        limit = t.output_limit(args.max_output_bytes, self.config.max_output_bytes)
        out_from = follower.stdout_cursor if args.stdout_offset is UNSET else args.stdout_offset
        err_from = follower.stderr_cursor if args.stderr_offset is UNSET else args.stderr_offset
        out, out_next, out_dropped, out_more = follower.stdout.read(out_from, limit)
        err, err_next, err_dropped, err_more = follower.stderr.read(err_from, limit)
        follower.stdout_cursor, follower.stderr_cursor = out_next, err_next
        exited = follower.done.is_set()
        return t.ProcessOutput(
            pid=args.pid, state="exited" if exited else "running", exit_code=follower.exit_code,
            stdout=as_text(out), stderr=as_text(err), next_stdout_offset=out_next, next_stderr_offset=err_next,
            more=out_more or err_more, dropped_bytes=out_dropped + err_dropped,
        )  # fmt: skip

    async def _process(self, ref: str, pid: int) -> Process:
        sandbox = await self._sandbox(ref)
        followed = self.followers.get((sandbox.id, pid))
        if followed is not None:
            return followed.proc
        return await sandbox.get_process(pid)

    async def write_process_stdin(self, args: t.WriteProcessStdinArgs) -> t.StdinWritten:
        proc = await self._process(args.sandbox, args.pid)
        data = args.data.encode("utf-8")
        await proc.write_stdin(data, close=args.close)
        return t.StdinWritten(pid=args.pid, written_bytes=len(data), closed=args.close)

    async def signal_process(self, args: t.SignalProcessArgs) -> t.Signalled:
        proc = await self._process(args.sandbox, args.pid)
        await proc.signal(args.signal)
        return t.Signalled(pid=args.pid, signal=args.signal)

    # -- files ---------------------------------------------------------------------------------------------

    async def read_file(self, args: t.ReadFileArgs) -> t.FileContent:
        limit = t.output_limit(args.max_bytes, self.config.max_output_bytes)
        sandbox = await self._sandbox(args.sandbox)
        # Only what this answer needs is read: offset + limit bytes, plus one to tell whether more follow.
        wanted = args.offset + limit + 1
        held = bytearray()
        async with contextlib.aclosing(sandbox.files.read_chunks(args.path)) as chunks:
            async for chunk in chunks:
                held += chunk
                if len(held) >= wanted:
                    break
        data = bytes(held)
        raw = page(data, args.offset, limit, text=False)
        encoding: Literal["utf-8", "base64"]
        try:
            got = page(data, args.offset, limit, text=True)
            content, encoding = got.data.decode("utf-8"), "utf-8"
            raw = got
        except UnicodeDecodeError:
            content, encoding = base64.b64encode(raw.data).decode("ascii"), "base64"
        return t.FileContent(
            path=args.path, content=content, encoding=encoding, offset=min(args.offset, len(data)),
            bytes=len(raw.data), next_offset=raw.next_offset, truncated=raw.more,
        )  # fmt: skip

    async def write_file(self, args: t.WriteFileArgs) -> t.FileWritten:
        if args.encoding == "base64":
            try:
                data = base64.b64decode(args.content, validate=True)
            except binascii.Error:
                raise InvalidRequest(
                    "content: expected standard base64 (A-Z a-z 0-9 + /, '=' padding) with encoding base64"
                ) from None
        else:
            data = args.content.encode("utf-8")
        sandbox = await self._sandbox(args.sandbox)
        await sandbox.files.write(args.path, data)
        return t.FileWritten(path=args.path, bytes=len(data))

    async def list_files(self, args: t.PathArgs) -> t.Listing:
        sandbox = await self._sandbox(args.sandbox)
        entries = await sandbox.files.list(args.path)
        shown = entries[: t.MAX_LISTED_ENTRIES]
        return t.Listing(
            path=args.path, entries=[t.Entry(name=e.name, type=e.type, size=e.size) for e in shown],
            total=len(entries), truncated=len(shown) < len(entries),
        )  # fmt: skip

    async def delete_file(self, args: t.PathArgs) -> t.Deleted:
        sandbox = await self._sandbox(args.sandbox)
        await sandbox.files.remove(args.path)
        return t.Deleted(path=args.path, deleted=True)

    # -- ports -------------------------------------------------------------------------------------------

    async def expose_port(self, args: t.ExposePortArgs) -> t.ExposedPort:
        if args.public and args.ttl_secs is not UNSET:
            raise InvalidRequest(
                "ttl_secs: a public port's URL does not expire; give ttl_secs only with public false"
            )
        sandbox = await self._sandbox(args.sandbox)
        port = await sandbox.ports.public(args.port, args.public)
        url, expires_at = port.url, None
        if not args.public:
            token = await sandbox.ports.token(args.port, None if args.ttl_secs is UNSET else args.ttl_secs)
            url, expires_at = token.url, token.expires_at
        return t.ExposedPort(
            sandbox=sandbox.id, port=port.port, url=url, public=port.public, listening=port.listening,
            expires_at=expires_at, note=t.port_note(port.public, port.listening, expires_at),
        )  # fmt: skip

    # -- snapshots -----------------------------------------------------------------------------------------

    async def snapshot_sandbox(self, args: t.SnapshotSandboxArgs) -> t.SnapshotSummary:
        sandbox = await self._sandbox(args.sandbox)
        snap: Snapshot = await sandbox.snapshot(args.kind)
        self.snapshots.add(snap.id)
        return t.SnapshotSummary(
            id=snap.id, sandbox=snap.sandbox, image=snap.image, kind=snap.kind, bytes=snap.bytes,
            created_at=snap.created_at,
        )  # fmt: skip

    async def delete_snapshot(self, args: t.SnapshotArgs) -> t.SnapshotDeleted:
        await self.client.snapshots.delete(args.snapshot_id)
        self.snapshots.discard(args.snapshot_id)
        return t.SnapshotDeleted(snapshot_id=args.snapshot_id, deleted=True)

    # -- dispatch ------------------------------------------------------------------------------------------

    def handler(self, name: str) -> Callable[[Any], Awaitable[msgspec.Struct]]:
        """The method implementing tool ``name`` (every name of ``tools.TOOLS`` has one)."""
        method: Callable[[Any], Awaitable[msgspec.Struct]] = getattr(self, name)
        return method
