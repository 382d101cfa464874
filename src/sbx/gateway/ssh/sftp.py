"""The ``sftp`` subsystem (and so ``sftp``, and ``scp`` in both its modes): the sandbox's files as its user.

An asyncssh ``SFTPServer`` whose operations are :class:`~sbx.gateway.ssh.guestfs.GuestFs` calls (the node's
files API and short commands) and whose open files are ``handles.Reader`` and ``handles.Writer``. Paths are the
guest's: a relative one is relative to the sandbox user's home (``/sandbox/home``); ``.`` and ``..`` are
resolved by name, as ``realpath`` answers. Names and owners are the guest's own (``ls -l`` shows ``sandbox``,
not a user of the gateway's host). Each failure carries the guest's reason: an SFTP status code (no such file,
permission denied, file exists, directory not empty, no space, ...; clients of protocol version 3 see those
past its list as a failure) and the message.
"""

from __future__ import annotations

import contextlib
import errno
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

import asyncssh

from sbx.api.errors import SandboxError
from sbx.api.validation import DEFAULT_CWD
from sbx.gateway.ssh.guestfs import Attrs, GuestError, GuestFs, SetAttrs, normalise
from sbx.gateway.ssh.handles import Reader, Writer, open_for_write

if TYPE_CHECKING:
    from sbx.gateway.ssh.server import SshConnection

#: Where relative paths start: the sandbox user's home.
HOME = DEFAULT_CWD

_ERRORS: dict[int, Callable[[str], asyncssh.SFTPError]] = {
    errno.ENOENT: asyncssh.SFTPNoSuchFile,
    errno.EACCES: asyncssh.SFTPPermissionDenied,
    errno.EPERM: asyncssh.SFTPPermissionDenied,
    errno.EEXIST: asyncssh.SFTPFileAlreadyExists,
    errno.ENOTEMPTY: asyncssh.SFTPDirNotEmpty,
    errno.ENOTDIR: asyncssh.SFTPNotADirectory,
    errno.EISDIR: asyncssh.SFTPFileIsADirectory,
    errno.ENOSPC: asyncssh.SFTPNoSpaceOnFilesystem,
    errno.EROFS: asyncssh.SFTPWriteProtect,
    errno.ELOOP: asyncssh.SFTPLinkLoop,
    errno.ENAMETOOLONG: asyncssh.SFTPInvalidFilename,
    errno.EINVAL: asyncssh.SFTPInvalidParameter,
    errno.ENOSYS: asyncssh.SFTPOpUnsupported,
}


def sftp_error(exc: GuestError) -> asyncssh.SFTPError:
    """The SFTP status of a guest failure."""
    return _ERRORS.get(exc.errno, asyncssh.SFTPFailure)(exc.message)


@contextlib.contextmanager
def guest_errors() -> Iterator[None]:
    """Turn guest failures into SFTP statuses (one boundary for every operation)."""
    try:
        yield
    except GuestError as exc:
        raise sftp_error(exc) from None


def sftp_attrs(attrs: Attrs) -> asyncssh.SFTPAttrs:
    return asyncssh.SFTPAttrs(
        type=_type(attrs.mode), size=attrs.size, uid=attrs.uid, gid=attrs.gid, owner=attrs.owner,
        group=attrs.group, permissions=attrs.mode, atime=attrs.atime, mtime=attrs.mtime, nlink=attrs.nlink,
    )  # fmt: skip


def set_attrs(attrs: asyncssh.SFTPAttrs) -> SetAttrs:
    return SetAttrs(size=attrs.size, permissions=attrs.permissions, atime=attrs.atime, mtime=attrs.mtime,
                    uid=attrs.uid, gid=attrs.gid)  # fmt: skip


def _type(mode: int) -> int:
    kinds = {
        stat.S_IFREG: asyncssh.FILEXFER_TYPE_REGULAR, stat.S_IFDIR: asyncssh.FILEXFER_TYPE_DIRECTORY,
        stat.S_IFLNK: asyncssh.FILEXFER_TYPE_SYMLINK,
    }  # fmt: skip
    return kinds.get(stat.S_IFMT(mode), asyncssh.FILEXFER_TYPE_SPECIAL)


class OpenFile:
    """An SFTP file handle: a reader, a writer, or both."""

    def __init__(self, path: str, reader: Reader | None, writer: Writer | None) -> None:
        self.path = path
        self.reader = reader
        self.writer = writer


class SandboxSftp(asyncssh.SFTPServer):
    """The SFTP server of one session, on the sandbox its connection logged in to."""

    def __init__(self, conn: SshConnection, chan: asyncssh.SSHServerChannel[bytes]) -> None:
        super().__init__(chan)
        self.conn = conn
        #: Owner and group names seen in this session, by id (for ``ls -l``).
        self._users: dict[int, str] = {}
        self._groups: dict[int, str] = {}

    # -- plumbing ------------------------------------------------------------------------------

    def _fs(self) -> GuestFs:
        login = self.conn.login
        assert login is not None
        try:
            node = self.conn.server.nodes.node_for(login.sandbox.node, f"sandbox {login.sandbox.id}")
        except SandboxError as exc:
            raise asyncssh.SFTPConnectionLost(exc.message) from None
        return GuestFs(node.client, login.sandbox.id)

    def _path(self, path: bytes) -> str:
        with guest_errors():
            return normalise(path, HOME)

    def _attrs(self, attrs: Attrs) -> asyncssh.SFTPAttrs:
        self._users[attrs.uid] = attrs.owner
        self._groups[attrs.gid] = attrs.group
        return sftp_attrs(attrs)

    def format_user(self, uid: int | None) -> str:
        return "" if uid is None else self._users.get(uid, str(uid))

    def format_group(self, gid: int | None) -> str:
        return "" if gid is None else self._groups.get(gid, str(gid))

    # -- names and attributes ------------------------------------------------------------------

    def realpath(self, path: bytes) -> bytes:
        return self._path(path).encode("utf-8")

    async def stat(self, path: bytes) -> asyncssh.SFTPAttrs:
        with guest_errors():
            return self._attrs(await self._fs().stat(self._path(path), follow=True))

    async def lstat(self, path: bytes) -> asyncssh.SFTPAttrs:
        with guest_errors():
            return self._attrs(await self._fs().stat(self._path(path), follow=False))

    async def fstat(self, file_obj: object) -> asyncssh.SFTPAttrs:
        handle = _handle(file_obj)
        with guest_errors():
            if handle.writer is not None:
                await handle.writer.flush()
            return self._attrs(await self._fs().stat(handle.path, follow=True))

    async def setstat(self, path: bytes, attrs: asyncssh.SFTPAttrs) -> None:
        with guest_errors():
            await self._fs().setstat(self._path(path), set_attrs(attrs))

    async def lsetstat(self, path: bytes, attrs: asyncssh.SFTPAttrs) -> None:
        with guest_errors():
            await self._fs().setstat(self._path(path), set_attrs(attrs), follow=False)

    async def fsetstat(self, file_obj: object, attrs: asyncssh.SFTPAttrs) -> None:
        handle = _handle(file_obj)
        with guest_errors():
            if handle.writer is not None:
                await handle.writer.flush()  # times set now must not be moved by data still to come
            await self._fs().setstat(handle.path, set_attrs(attrs))

    async def scandir(self, path: bytes) -> AsyncIterator[asyncssh.SFTPName]:
        with guest_errors():
            entries = await self._fs().list_dir(self._path(path))
        for attrs in entries:
            yield asyncssh.SFTPName(
                attrs.name.encode("utf-8", errors="surrogateescape"), attrs=self._attrs(attrs)
            )

    async def statvfs(self, path: bytes) -> asyncssh.SFTPVFSAttrs:
        with guest_errors():
            vfs = await self._fs().statvfs(self._path(path))
        return asyncssh.SFTPVFSAttrs(
            bsize=vfs.bsize, frsize=vfs.frsize, blocks=vfs.blocks, bfree=vfs.bfree, bavail=vfs.bavail,
            files=vfs.files, ffree=vfs.ffree, favail=vfs.ffree, namemax=vfs.namemax,
        )  # fmt: skip

    async def fstatvfs(self, file_obj: object) -> asyncssh.SFTPVFSAttrs:
        return await self.statvfs(_handle(file_obj).path.encode("utf-8"))

    # -- changes -------------------------------------------------------------------------------

    async def mkdir(self, path: bytes, attrs: asyncssh.SFTPAttrs) -> None:
        with guest_errors():
            await self._fs().mkdir(self._path(path), attrs.permissions)

    async def rmdir(self, path: bytes) -> None:
        with guest_errors():
            await self._fs().rmdir(self._path(path))

    async def remove(self, path: bytes) -> None:
        with guest_errors():
            await self._fs().remove(self._path(path))

    async def rename(self, oldpath: bytes, newpath: bytes) -> None:
        with guest_errors():
            await self._fs().rename(self._path(oldpath), self._path(newpath), overwrite=False)

    async def posix_rename(self, oldpath: bytes, newpath: bytes) -> None:
        with guest_errors():
            await self._fs().rename(self._path(oldpath), self._path(newpath), overwrite=True)

    async def readlink(self, path: bytes) -> bytes:
        with guest_errors():
            return (await self._fs().readlink(self._path(path))).encode("utf-8", errors="surrogateescape")

    async def symlink(self, oldpath: bytes, newpath: bytes) -> None:
        # The target is stored as given (a relative one stays relative to the link), as symlink(2) does.
        with guest_errors():
            target = oldpath.decode("utf-8")
            await self._fs().symlink(target, self._path(newpath))

    async def link(self, oldpath: bytes, newpath: bytes) -> None:
        with guest_errors():
            await self._fs().link(self._path(oldpath), self._path(newpath))

    # -- open files ----------------------------------------------------------------------------

    async def open(self, path: bytes, pflags: int, attrs: asyncssh.SFTPAttrs) -> OpenFile:
        target = self._path(path)
        fs = self._fs()
        reading = bool(pflags & asyncssh.FXF_READ) or not pflags & asyncssh.FXF_WRITE
        writing = bool(pflags & asyncssh.FXF_WRITE)
        reader = writer = None
        with guest_errors():
            if writing:
                writer = await open_for_write(
                    fs, target, create=bool(pflags & asyncssh.FXF_CREAT), truncate=bool(pflags & asyncssh.FXF_TRUNC),
                    exclusive=bool(pflags & asyncssh.FXF_EXCL), append=bool(pflags & asyncssh.FXF_APPEND),
                    permissions=attrs.permissions,
                )  # fmt: skip
            if reading:
                if writer is not None:
                    await writer.flush()
                reader = Reader(fs, target)
                await reader.open()
        return OpenFile(target, reader, writer)

    async def read(self, file_obj: object, offset: int, size: int) -> bytes:
        handle = _handle(file_obj)
        if handle.reader is None:
            raise asyncssh.SFTPPermissionDenied("this file was opened for writing only")
        with guest_errors():
            if handle.writer is not None:
                await handle.writer.flush()
            return await handle.reader.read(offset, size)

    async def write(self, file_obj: object, offset: int, data: bytes) -> int:
        handle = _handle(file_obj)
        if handle.writer is None:
            raise asyncssh.SFTPPermissionDenied("this file was opened for reading only")
        with guest_errors():
            await handle.writer.write(offset, data)
        return len(data)

    async def fsync(self, file_obj: object) -> None:
        handle = _handle(file_obj)
        if handle.writer is not None:
            with guest_errors():
                await handle.writer.flush()

    async def close(self, file_obj: object) -> None:
        handle = _handle(file_obj)
        if handle.reader is not None:
            handle.reader.close()
        if handle.writer is None:
            return
        if _client_gone(self.channel):
            # The session ended with the file open (a cut upload: a client closes its files first): what a PUT
            # was streaming is dropped, so the file keeps its old contents; bytes dd has written stay.
            handle.writer.abort()
            return
        with guest_errors():
            await handle.writer.close()

    def exit(self) -> None:
        """The session ended (asyncssh has closed every handle still open): report exit status 0, as sshd does
        when its sftp-server exits; scp in its sftp mode fails without one. (The legacy scp server has already
        reported its own.)"""
        self.conn.file_sessions.discard(self)
        with contextlib.suppress(OSError):
            self.channel.exit(0)


def _client_gone(chan: asyncssh.SSHServerChannel[bytes]) -> bool:
    """Whether the client has sent EOF or gone away: asyncssh then closes the files still open itself. (Read from
    the channel's receive state, which asyncssh keeps private; the integration test of a cut upload holds it.)"""
    return chan.is_closing() or getattr(chan, "_recv_state", "open") != "open"


def _handle(file_obj: object) -> OpenFile:
    assert isinstance(file_obj, OpenFile)
    return file_obj
