"""A sandbox's file system as the sandbox user, through its node's public API: what the SFTP server serves.

Data goes through the files API: reads stream ``GET .../files``; a file written from its start (an upload)
streams ``PUT .../files``. What the files API does not offer is done by short commands run as the sandbox user
(``POST .../run``; the caller's names only ever as arguments, never in a shell's script): ``find -printf``
for attributes and listings, ``mkdir``, ``rmdir``, ``rm``, ``mv``, ``ln``, ``readlink``, ``chmod``, ``touch``,
``truncate``, ``chown``, ``stat -f`` for ``df``, and ``dd`` for reads and writes at an offset (random access,
appends, and the part of an upload past the node's 64 MiB PUT body cap). They are GNU coreutils and findutils,
in every Debian, Ubuntu or Fedora image; a missing one makes that one operation unsupported, with a message
naming it (busybox's ``find`` has no ``-printf``: add findutils to such an image). Why commands and not a
node API addition: docs/ssh.md ("sftp").

Every failure is a :class:`GuestError` carrying an ``errno`` (from the node's answer, or the command's message)
and a message safe to show.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import posixpath
import stat
from collections.abc import AsyncIterable, Sequence
from dataclasses import dataclass, replace

import aiohttp
import msgspec

from sbx.api import frames
from sbx.api.errors import Conflict, InvalidRequest, NotFound, Refused, SandboxError
from sbx.api.processes import ProcessRequest, RunRequest
from sbx.gateway.nodeclient import NodeClient

#: The guest's environment for commands: messages in English, so their errno can be read from them.
COMMAND_ENV = {"LC_ALL": "C"}
#: Seconds a metadata command may run.
COMMAND_TIMEOUT_SECS = 60
#: ``find -printf`` format of one :class:`Attrs` record: type letter, permission bits (octal), links, uid, gid,
#: size, atime, mtime, owner and group names, then the name, NUL-terminated (a name may hold any byte but NUL).
#: ``find`` rather than ``stat``: coreutils' ``stat`` and ``ls -l`` use statx(2), which older gVisor refuses.
FIND_FORMAT = "%y %m %n %U %G %s %A@ %T@ %u %g %f\\0"
#: ``stat -f -c`` format of :class:`VfsAttrs`.
STATFS_FORMAT = "%S %s %b %f %a %c %d %l"
_TYPES = {
    "f": stat.S_IFREG, "d": stat.S_IFDIR, "l": stat.S_IFLNK, "b": stat.S_IFBLK, "c": stat.S_IFCHR,
    "p": stat.S_IFIFO, "s": stat.S_IFSOCK,
}  # fmt: skip

# A command's message, and the errno it means (coreutils and busybox say the same thing).
_MESSAGES: tuple[tuple[str, int], ...] = (
    ("No such file or directory", errno.ENOENT),
    ("Permission denied", errno.EACCES),
    ("Operation not permitted", errno.EPERM),
    ("File exists", errno.EEXIST),
    ("Not a directory", errno.ENOTDIR),
    ("Is a directory", errno.EISDIR),
    ("Directory not empty", errno.ENOTEMPTY),
    ("No space left on device", errno.ENOSPC),
    ("Read-only file system", errno.EROFS),
    ("Too many levels of symbolic links", errno.ELOOP),
    ("File name too long", errno.ENAMETOOLONG),
    ("Invalid argument", errno.EINVAL),
)


class GuestError(Exception):
    """A file operation failed in the sandbox: ``errno`` (0 when unknown) and a message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.errno = code
        self.message = message


class Unsupported(GuestError):
    """The image lacks the command an operation needs."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSYS, message)


@dataclass(frozen=True)
class Attrs:
    """What ``find`` says of a file: its name, mode (type and permission bits), times in epoch seconds."""

    name: str
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    atime: int
    mtime: int
    owner: str
    group: str


@dataclass(frozen=True)
class VfsAttrs:
    """What ``stat -f`` says of a file system."""

    frsize: int
    bsize: int
    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    namemax: int


@dataclass(frozen=True)
class SetAttrs:
    """Attributes to change; None leaves one as it is."""

    size: int | None = None
    permissions: int | None = None
    atime: int | None = None
    mtime: int | None = None
    uid: int | None = None
    gid: int | None = None


def node_error(exc: SandboxError, path: str) -> GuestError:
    """The GuestError of a node's refusal of a files API call on ``path``."""
    message = exc.message
    if isinstance(exc, NotFound):
        return GuestError(errno.ENOENT, message)
    if isinstance(exc, Refused):
        return GuestError(errno.EACCES, message)
    if isinstance(exc, Conflict):
        if " exists" in message:  # "PATH exists and is not a directory"
            return GuestError(errno.EEXIST, message)
        for text, code in _MESSAGES:
            if text.lower() in message.lower():
                return GuestError(code, message)
        return GuestError(errno.EEXIST, message)
    if isinstance(exc, InvalidRequest) and message.endswith("is a directory"):
        return GuestError(errno.EISDIR, message)
    if isinstance(exc, InvalidRequest) and "is not a directory" in message:
        return GuestError(errno.ENOTDIR, message)
    return GuestError(0, f"{path}: {message}")


def command_error(tool: str, exit_code: int, stderr: bytes) -> GuestError:
    """The GuestError of a failed command, from its message."""
    text = stderr.decode("utf-8", errors="replace").strip().splitlines()
    message = text[-1] if text else f"{tool} exited with {exit_code}"
    if exit_code == 127 or ("not found" in message and tool in message):
        return Unsupported(f"this sandbox's image has no {tool!r} command, which this operation needs")
    for known, code in _MESSAGES:
        if known in message:
            return GuestError(code, message)
    return GuestError(0, message)


def parse_records(out: bytes) -> list[Attrs]:
    """The records of ``find -printf FIND_FORMAT``; names are decoded with surrogateescape (any bytes)."""
    found = []
    for record in out.split(b"\0"):
        if not record:
            continue
        fields = record.decode("utf-8", errors="surrogateescape").split(" ", 10)
        if len(fields) != 11 or fields[0] not in _TYPES:
            raise GuestError(0, f"unexpected find output {record[:80]!r}")
        found.append(Attrs(
            name=fields[10], mode=_TYPES[fields[0]] | int(fields[1], 8), nlink=int(fields[2]), uid=int(fields[3]),
            gid=int(fields[4]), size=int(fields[5]), atime=int(float(fields[6])), mtime=int(float(fields[7])),
            owner=fields[8], group=fields[9],
        ))  # fmt: skip
    return found


class GuestFs:
    """File operations in one sandbox, as its user."""

    def __init__(self, client: NodeClient, sandbox_id: str) -> None:
        self.client = client
        self.sandbox_id = sandbox_id

    # -- commands ------------------------------------------------------------------------------

    async def command(self, argv: Sequence[str], cwd: str | None = None) -> bytes:
        """Run ``argv`` to completion as the sandbox user; its stdout, or ``GuestError``."""
        request = RunRequest(argv=list(argv), env=dict(COMMAND_ENV), timeout_secs=COMMAND_TIMEOUT_SECS)
        if cwd is not None:
            request = msgspec.structs.replace(request, cwd=cwd)
        try:
            result = await self.client.run(self.sandbox_id, request, COMMAND_TIMEOUT_SECS + 10)
        except InvalidRequest as exc:
            if "does not exist" in exc.message or "not found" in exc.message:
                raise Unsupported(
                    f"this sandbox's image has no {argv[0]!r} command, which this operation needs"
                ) from None
            raise GuestError(0, exc.message) from None
        except SandboxError as exc:
            raise GuestError(0, exc.message) from None
        if result.timed_out:
            raise GuestError(errno.ETIMEDOUT, f"{argv[0]} did not finish within {COMMAND_TIMEOUT_SECS} s")
        if result.exit_code != 0:
            raise command_error(argv[0], result.exit_code, result.stderr)
        return result.stdout

    async def stat(self, path: str, follow: bool) -> Attrs:
        """``stat`` (``follow``) or ``lstat`` of ``path`` (absolute, so ``find`` never reads it as an option)."""
        out = await self.command(
            ["find", *(["-L"] if follow else []), path, "-maxdepth", "0", "-printf", FIND_FORMAT]
        )
        found = parse_records(out)
        if len(found) != 1:
            raise GuestError(errno.ENOENT, f"{path}: No such file or directory")
        if follow and stat.S_ISLNK(found[0].mode):  # find -L reports a dangling link as the link
            raise GuestError(errno.ENOENT, f"{path}: No such file or directory (a dangling symbolic link)")
        return found[0]

    async def list_dir(self, path: str) -> list[Attrs]:
        """A directory's entries with their attributes (as ``lstat``), ``.`` and ``..`` first."""
        script = (
            'find "$1" -maxdepth 0 -printf "$3" && find "$2" -maxdepth 0 -printf "$3" && '
            'find "$1" -mindepth 1 -maxdepth 1 -printf "$3"'
        )
        parent = posixpath.join(path, "..")
        found = parse_records(await self.command(["sh", "-c", script, "sh", path, parent, FIND_FORMAT]))
        if len(found) < 2 or not stat.S_ISDIR(found[0].mode):
            raise GuestError(errno.ENOTDIR, f"{path}: Not a directory")
        return [replace(found[0], name="."), replace(found[1], name=".."), *found[2:]]

    async def statvfs(self, path: str) -> VfsAttrs:
        out = (await self.command(["stat", "-f", "-c", STATFS_FORMAT, "--", path])).decode()
        values = [int(v) for v in out.split()[:8]]
        if len(values) != 8:
            raise GuestError(0, f"unexpected stat -f output {out[:80]!r}")
        return VfsAttrs(*values)

    async def mkdir(self, path: str, permissions: int | None) -> None:
        mode = ["-m", f"{permissions & 0o7777:o}"] if permissions is not None else []
        await self.command(["mkdir", *mode, "--", path])

    async def rmdir(self, path: str) -> None:
        await self.command(["rmdir", "--", path])

    async def remove(self, path: str) -> None:
        await self.command(["rm", "--", path])

    async def rename(self, old: str, new: str, overwrite: bool) -> None:
        """Rename; without ``overwrite`` an existing ``new`` is EEXIST (SFTP's rename), with it replaced
        (POSIX rename)."""
        if not overwrite:
            script = '[ -e "$2" ] || [ -L "$2" ] && { echo "$2: File exists" >&2; exit 1; }; exec mv -f -- "$1" "$2"'
            await self.command(["sh", "-c", script, "sh", old, new])
        else:
            await self.command(["mv", "-f", "-T", "--", old, new])

    async def readlink(self, path: str) -> str:
        return (
            (await self.command(["readlink", "--", path]))
            .decode("utf-8", errors="surrogateescape")
            .rstrip("\n")
        )

    async def symlink(self, target: str, link: str) -> None:
        await self.command(["ln", "-s", "--", target, link])

    async def link(self, old: str, new: str) -> None:
        await self.command(["ln", "--", old, new])

    async def ensure_file(self, path: str) -> None:
        """Create ``path`` empty when absent; an existing file is left as it is."""
        await self.command(["sh", "-c", ': >> "$1"', "sh", path])

    async def setstat(self, path: str, attrs: SetAttrs, follow: bool = True) -> None:
        """Change what ``attrs`` names, in one command: owner, size, permissions, then times (last, so the
        others do not move them)."""
        steps: list[str] = []
        args: list[str] = [path]
        if attrs.uid is not None or attrs.gid is not None:
            owner = f"{'' if attrs.uid is None else attrs.uid}:{'' if attrs.gid is None else attrs.gid}"
            steps.append(f'chown {"" if follow else "-h "}-- "{_arg(args, owner)}" "$1"')
        if attrs.size is not None:
            steps.append(f'truncate -s "{_arg(args, str(attrs.size))}" -- "$1"')
        if attrs.permissions is not None:
            steps.append(f'chmod "{_arg(args, format(attrs.permissions & 0o7777, "o"))}" -- "$1"')
        if attrs.mtime is not None:
            steps.append(f'touch {"" if follow else "-h "}-m -d "@{_arg(args, str(attrs.mtime))}" -- "$1"')
        if attrs.atime is not None:
            steps.append(f'touch {"" if follow else "-h "}-a -d "@{_arg(args, str(attrs.atime))}" -- "$1"')
        if steps:
            await self.command(["sh", "-c", "set -e; " + "; ".join(steps), "sh", *args])

    # -- data ----------------------------------------------------------------------------------

    async def open_read(self, path: str) -> aiohttp.ClientResponse:
        """The answer of ``GET .../files`` for ``path``, its body to be streamed (close it when done)."""
        try:
            return await self.client.read_file(self.sandbox_id, path)
        except SandboxError as exc:
            raise node_error(exc, path) from None

    async def read_range(self, path: str, offset: int, size: int) -> bytes:
        """``size`` bytes (fewer at the end) from ``offset``, by ``dd`` (a read out of order)."""
        out = await self.command(["dd", f"if={path}", f"skip={offset}", f"count={size}", "bs=64K",
                                  "iflag=skip_bytes,count_bytes", "status=none"])  # fmt: skip
        return out[:size]  # what the guest's dd printed, never more than was asked

    async def put(self, path: str, chunks: AsyncIterable[bytes]) -> None:
        """Replace ``path`` with ``chunks`` (``PUT .../files``; at most the node's 64 MiB body cap)."""
        try:
            await self.client.write_file(self.sandbox_id, path, chunks)
        except SandboxError as exc:
            raise node_error(exc, path) from None

    async def open_writer(self, path: str, offset: int | None) -> DdWriter:
        """A ``dd`` writing its stdin into ``path`` at ``offset`` (None: appending), not truncating."""
        where = ["oflag=append"] if offset is None else [f"seek={offset}", "oflag=seek_bytes"]
        argv = ["dd", f"of={path}", "bs=64K", *where, "conv=notrunc", "status=none"]
        try:
            started = await self.client.start_process(
                self.sandbox_id, ProcessRequest(argv=argv, env=dict(COMMAND_ENV))
            )
            reader, writer = await self.client.attach(self.sandbox_id, started.pid)
        except InvalidRequest as exc:
            if "does not exist" in exc.message or "not found" in exc.message:
                raise Unsupported(
                    "this sandbox's image has no 'dd' command, which this write needs"
                ) from None
            raise node_error(exc, path) from None
        except SandboxError as exc:
            raise node_error(exc, path) from None
        return DdWriter(self, started.pid, reader, writer)


class DdWriter:
    """A running ``dd`` fed through its stdin (attach frames)."""

    def __init__(
        self, fs: GuestFs, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.fs = fs
        self.pid = pid
        self.reader = reader
        self.writer = writer

    async def write(self, data: bytes) -> None:
        try:
            self.writer.write(frames.encode_chunks(frames.STDIN, data))
            await self.writer.drain()
        except (ConnectionError, OSError):
            # dd stopped reading (it failed: no space, no permission...): its reason, from a second attach.
            await self._outcome(again=True)
            raise GuestError(errno.EIO, "the write stopped: dd exited before its input ended") from None

    async def close(self) -> None:
        """End the input and wait for ``dd`` to exit; ``GuestError`` with its message when it failed."""
        try:
            self.writer.write(frames.encode_frame(frames.END_OF_INPUT))
            await self.writer.drain()
        except (ConnectionError, OSError):
            await self._outcome(again=True)
            return
        await self._outcome(again=False)

    async def _outcome(self, again: bool) -> None:
        """Read dd's stderr and exit (attaching again when this stream broke: the node replays a process's
        output); ``GuestError`` unless it exited 0."""
        reader, writer = self.reader, self.writer
        try:
            if again:
                writer.close()
                reader, writer = await self.fs.client.attach(self.fs.sandbox_id, self.pid)
                writer.write_eof()  # nothing more to send; a half-closed client still gets the output and exit
            decoder = frames.FrameDecoder(frames.SERVER_TYPES)
            errors = bytearray()
            while data := await reader.read(64 * 1024):
                for frame in decoder.feed(data):
                    if frame.type == frames.STDERR:
                        errors += frame.payload[: 4096 - len(errors)]
                    elif frame.type == frames.EXIT:
                        code = frames.decode_exit(frame.payload)
                        if code != 0:
                            raise command_error("dd", code, bytes(errors))
                        return
        except (ConnectionError, OSError, InvalidRequest, SandboxError) as exc:
            raise GuestError(errno.EIO, f"the write stopped: {exc}") from None
        finally:
            writer.close()
        raise GuestError(errno.EIO, "the write stopped: the node's stream ended without dd's exit")

    def abort(self) -> None:
        """Stop writing: end dd's input (so it exits with what it has; a detached process would wait for its
        stdin forever) and close the stream."""
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            self.writer.write(frames.encode_frame(frames.END_OF_INPUT))
        self.writer.close()


def _arg(args: list[str], value: str) -> str:
    """Append ``value`` to the script's positional arguments; the ``$N`` that names it."""
    args.append(value)
    return f"${{{len(args)}}}"


def normalise(path: bytes, home: str) -> str:
    """An SFTP path as an absolute guest path: relative to ``home``, ``.`` and ``..`` resolved by name (not
    following links, as a shell's ``cd`` does), no NUL. ``GuestError`` when it is not UTF-8."""
    try:
        text = path.decode("utf-8")
    except UnicodeDecodeError:
        raise GuestError(errno.EINVAL, "file names must be UTF-8 through this server") from None
    if "\x00" in text:
        raise GuestError(errno.EINVAL, "a file name cannot contain NUL")
    joined = posixpath.normpath(posixpath.join(home, text))
    return "/" + joined.lstrip("/")
