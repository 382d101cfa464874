"""Files and directories inside a sandbox, through its agent, as the sandbox user."""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator

from aiohttp import web

from sbx.agent.client import AgentClient, AgentFileError
from sbx.api.errors import Conflict, InvalidRequest, NotFound, Refused, SandboxError, Unavailable
from sbx.api.files import DirEntry, DirListing
from sbx.api.validation import validate_guest_path
from sbx.backends.base import GuestUser
from sbx.node.context import NodeContext
from sbx.node.sandbox import Sandbox
from sbx.web.http import FILE_BODY_CAP, json_response, query_one, stream_body


def file_error(exc: AgentFileError, path: str, guest: GuestUser) -> SandboxError:
    """The API error for a failed file operation in the guest, made as the backend's ``guest`` user."""
    code = exc.errno
    if code == errno.ENOENT:
        return NotFound(f"no such file or directory: {path}")
    # A read-only tree of the image (GuestUser.read_only_trees) was the user's to write no more than before it
    # was read-only: refused as then (volumes are never mounted there, so a volume's 409 is not hidden).
    if code in (errno.EACCES, errno.EPERM) or (code == errno.EROFS and guest.in_read_only_tree(path)):
        return Refused(f"permission denied: {path} (files are accessed as the sandbox user, uid {guest.uid})")
    if code == errno.EROFS:
        return Conflict("read-only file system")
    if code == errno.ENOSPC:
        return Conflict(
            f"no space left on device while writing {path}: the sandbox's disk_mb "
            "(or, under a volume's mount path, the volume's size_mb) is used up"
        )
    if code == errno.ENOTEMPTY:
        return Conflict(f"directory not empty: {path}")
    if code == errno.EISDIR:
        return InvalidRequest(f"{path} is a directory")
    if code == errno.ENOTDIR:
        return InvalidRequest(f"a component of {path} is not a directory")
    if code == errno.EEXIST:
        return Conflict(f"{path} exists and is not a directory")
    if code == errno.ENAMETOOLONG:
        return InvalidRequest(f"path too long: {path}")
    if code == errno.EMFILE:  # the host's cap on transfers at once per sandbox (sbx.agent.client)
        return Unavailable(exc.message)
    return InvalidRequest(f"{path}: {exc}")


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    audit = ctx.audit

    guest = ctx.backend.guest
    uid, gid = guest.uid, guest.gid

    async def target(request: web.Request) -> tuple[Sandbox, str, AgentClient]:
        """The running sandbox (woken if parked, or if a dormant persistent one), the checked guest path, and the
        agent that will act on it."""
        sandbox = ctx.manager.resolve_guest(request.match_info["ref"])
        path = validate_guest_path(query_one(request, "path"))
        await ctx.manager.wake_for_guest(sandbox)
        await sandbox.wake()
        return sandbox, path, sandbox.processes.require_agent()

    async def read(request: web.Request) -> web.StreamResponse:
        sandbox, path, agent = await target(request)
        try:
            reader = await agent.open_read(path, uid, gid)
        except AgentFileError as exc:
            raise file_error(exc, path, guest) from None
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = reader.size
        total = 0
        try:
            await response.prepare(request)
            async for chunk in reader:
                total += len(chunk)
                await response.write(chunk)
        finally:
            await reader.aclose()
        await response.write_eof()
        audit.record("file.read", sandbox.record.id, path=path, bytes=total)
        return response

    async def write(request: web.Request) -> web.Response:
        sandbox, path, agent = await target(request)
        if path == "/":
            raise InvalidRequest("cannot write to /: name a file")
        counted = _Counted(stream_body(request, FILE_BODY_CAP))
        try:
            await agent.write_file(path, counted, uid, gid)
        except AgentFileError as exc:
            raise file_error(exc, path, guest) from None
        audit.record("file.written", sandbox.record.id, path=path, bytes=counted.total)
        return web.Response(status=204)

    async def remove(request: web.Request) -> web.Response:
        sandbox, path, agent = await target(request)
        if path == "/":
            raise InvalidRequest("cannot remove /")
        try:
            size = (await agent.stat(path, uid, gid)).size
            await agent.remove(path, uid, gid)
        except AgentFileError as exc:
            raise file_error(exc, path, guest) from None
        audit.record("file.removed", sandbox.record.id, path=path, bytes=size)
        return web.Response(status=204)

    async def list_dir(request: web.Request) -> web.Response:
        _, path, agent = await target(request)
        try:
            entries = await agent.list_dir(path, uid, gid)
        except AgentFileError as exc:
            raise file_error(exc, path, guest) from None
        return json_response(
            DirListing([DirEntry(e.name, e.type, e.size) for e in sorted(entries, key=lambda e: e.name)])
        )

    base = "/v1/sandboxes/{ref}"
    return [
        web.get(f"{base}/files", read),
        web.put(f"{base}/files", write),
        web.delete(f"{base}/files", remove),
        web.get(f"{base}/dirs", list_dir),
    ]


class _Counted:
    """Passes chunks through, counting bytes (for the audit record)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks
        self.total = 0

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[bytes]:
        async for chunk in self.chunks:
            self.total += len(chunk)
            yield chunk
