"""The SSH server's pieces that need no sandbox: sftp's guest file operations (records, errors, paths, the
commands they run), open files (which writes go to a PUT, which to dd; reads from the stream or by dd), and the
process a session runs."""

from __future__ import annotations

import asyncio
import errno
import io
import stat
from collections.abc import AsyncIterable
from typing import Any, cast

import pytest

from sbx.api.errors import Conflict, InvalidRequest, NotFound, Refused, Unavailable
from sbx.api.processes import LOGIN_SHELL
from sbx.gateway.ssh import handles
from sbx.gateway.ssh.guestfs import (
    FIND_FORMAT,
    GuestError,
    GuestFs,
    SetAttrs,
    Unsupported,
    command_error,
    node_error,
    normalise,
    parse_records,
)
from sbx.gateway.ssh.handles import Reader, Writer, open_for_write
from sbx.gateway.ssh.sessions import COMMAND_SHELL, process_request, safe_env
from sbx.gateway.ssh.sftp import sftp_error

# -- records, errors, paths ------------------------------------------------------------------------------------


def _record(kind: str, perms: str, name: str, size: int = 6) -> bytes:
    return (
        f"{kind} {perms} 1 1000 1000 {size} 1700000000.5 1700000001.25 sandbox sandbox {name}".encode()
        + b"\0"
    )


def test_find_records_keep_any_name() -> None:
    out = _record("f", "644", "a b") + _record("d", "1777", "new\nline") + _record("l", "777", "x y z", 3)
    found = parse_records(out)
    assert [a.name for a in found] == ["a b", "new\nline", "x y z"]
    assert found[0].mode == stat.S_IFREG | 0o644 and found[1].mode == stat.S_IFDIR | 0o1777
    assert stat.S_ISLNK(found[2].mode) and found[2].size == 3
    assert (found[0].atime, found[0].mtime, found[0].owner, found[0].nlink) == (
        1700000000,
        1700000001,
        "sandbox",
        1,
    )
    assert parse_records(b"") == []
    assert parse_records(b"f 644 1 1000 1000 1 1.0 1.0 sandbox sandbox \xff\0")[0].name == "\udcff"


@pytest.mark.parametrize("bad", [b"garbage\0", b"q 644 1 1000 1000 1 1.0 1.0 a b c\0"])
def test_find_records_refuse_what_find_does_not_print(bad: bytes) -> None:
    with pytest.raises(GuestError):
        parse_records(bad)


def test_the_find_format_ends_records_with_nul() -> None:
    assert FIND_FORMAT.endswith("%f\\0") and FIND_FORMAT.count("%") == 11


@pytest.mark.parametrize(
    ("tool", "code", "stderr", "expected"),
    [
        ("mkdir", 1, b"mkdir: cannot create directory 'x': File exists\n", errno.EEXIST),
        ("rm", 1, b"rm: cannot remove 'x': No such file or directory\n", errno.ENOENT),
        ("rmdir", 1, b"rmdir: failed to remove 'x': Directory not empty\n", errno.ENOTEMPTY),
        ("rm", 1, b"rm: cannot remove '/tmp': Is a directory\n", errno.EISDIR),
        ("mv", 1, b"mv: cannot move 'a' to 'b': Permission denied\n", errno.EACCES),
        ("chmod", 1, b"chmod: changing permissions of 'x': Operation not permitted\n", errno.EPERM),
        ("dd", 1, b"dd: error writing 'x': No space left on device\n", errno.ENOSPC),
        ("touch", 1, b"touch: cannot touch 'x': Read-only file system\n", errno.EROFS),
        ("stat", 1, b"stat: odd\n", 0),
        ("truncate", 127, b"sh: 1: truncate: not found\n", errno.ENOSYS),
    ],
)
def test_command_errors(tool: str, code: int, stderr: bytes, expected: int) -> None:
    error = command_error(tool, code, stderr)
    assert error.errno == expected
    if expected == errno.ENOSYS:
        assert isinstance(error, Unsupported)
        assert error.message == "this sandbox's image has no 'truncate' command, which this operation needs"
    else:
        assert error.message == stderr.decode().strip()


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (NotFound("no such file or directory: /x"), errno.ENOENT),
        (Refused("permission denied: /x"), errno.EACCES),
        (Conflict("read-only file system"), errno.EROFS),
        (Conflict("no space left on device while writing /x: ..."), errno.ENOSPC),
        (Conflict("directory not empty: /x"), errno.ENOTEMPTY),
        (Conflict("/x exists and is not a directory"), errno.EEXIST),
        (InvalidRequest("/x is a directory"), errno.EISDIR),
        (Unavailable("too many transfers"), 0),
    ],
)
def test_node_errors(exc: Any, expected: int) -> None:
    assert node_error(exc, "/x").errno == expected


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (errno.ENOENT, 2),
        (errno.EACCES, 3),
        (errno.EEXIST, 11),
        (errno.ENOTEMPTY, 18),
        (errno.ENOSYS, 8),
        (0, 4),
    ],
)
def test_sftp_status_of_a_guest_error(code: int, status: int) -> None:
    error = sftp_error(GuestError(code, "why"))
    assert (error.code, error.reason) == (status, "why")


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (b".", "/sandbox/home"),
        (b"", "/sandbox/home"),
        (b"a/../b", "/sandbox/home/b"),
        (b"../../../../etc/passwd", "/etc/passwd"),
        (b"/", "/"),
        (b"//tmp//x/", "/tmp/x"),
        (b"/a/./b/..", "/a"),
    ],
)
def test_paths_are_resolved_by_name(path: bytes, expected: str) -> None:
    assert normalise(path, "/sandbox/home") == expected


@pytest.mark.parametrize(("path", "code"), [(b"\xff", errno.EINVAL), (b"a\0b", errno.EINVAL)])
def test_paths_refused(path: bytes, code: int) -> None:
    with pytest.raises(GuestError) as caught:
        normalise(path, "/sandbox/home")
    assert caught.value.errno == code


# -- guest file operations as commands ----------------------------------------------------------------------


class CommandFs(GuestFs):
    """A GuestFs whose commands are recorded and answered from a list."""

    def __init__(self, answers: list[bytes | GuestError] | None = None) -> None:
        super().__init__(cast(Any, None), "sbx_test")
        self.commands: list[list[str]] = []
        self.answers = list(answers or [])
        self.puts: list[bytes] = []

    async def command(self, argv: Any, cwd: str | None = None) -> bytes:
        self.commands.append(list(argv))
        answer = self.answers.pop(0) if self.answers else b""
        if isinstance(answer, GuestError):
            raise answer
        return answer

    async def put(self, path: str, chunks: AsyncIterable[bytes]) -> None:
        self.puts.append(b"".join([c async for c in chunks]))


async def test_setstat_is_one_script_with_values_as_arguments() -> None:
    fs = CommandFs()
    await fs.setstat("/x; rm -rf /", SetAttrs(size=0, permissions=0o100755, mtime=5, atime=6, uid=1000))
    (argv,) = fs.commands
    assert argv[:2] == ["sh", "-c"] and argv[3:] == ["sh", "/x; rm -rf /", "1000:", "0", "755", "5", "6"]
    assert argv[2] == ('set -e; chown -- "${2}" "$1"; truncate -s "${3}" -- "$1"; chmod "${4}" -- "$1"; '
                       'touch -m -d "@${5}" -- "$1"; touch -a -d "@${6}" -- "$1"')  # fmt: skip
    await fs.setstat("/x", SetAttrs())
    assert len(fs.commands) == 1  # nothing to change: no command
    await fs.setstat("/x", SetAttrs(mtime=1), follow=False)
    assert "touch -h -m" in fs.commands[-1][2]


async def test_stat_and_listing_read_find_records() -> None:
    fs = CommandFs([_record("f", "600", "x")])
    attrs = await fs.stat("/a/x", follow=True)
    assert fs.commands[0] == ["find", "-L", "/a/x", "-maxdepth", "0", "-printf", FIND_FORMAT]
    assert attrs.mode == stat.S_IFREG | 0o600
    dangling = CommandFs([_record("l", "777", "x")])
    with pytest.raises(GuestError) as caught:
        await dangling.stat("/a/x", follow=True)
    assert caught.value.errno == errno.ENOENT
    listing = CommandFs([_record("d", "755", "a") + _record("d", "755", "/") + _record("f", "644", "f")])
    assert [a.name for a in await listing.list_dir("/a")] == [".", "..", "f"]
    not_dir = CommandFs([_record("f", "644", "a") + _record("d", "755", "/")])
    with pytest.raises(GuestError) as caught:
        await not_dir.list_dir("/a")
    assert caught.value.errno == errno.ENOTDIR


async def test_rename_keeps_sftp_and_posix_meanings_apart() -> None:
    fs = CommandFs()
    await fs.rename("/a", "/b", overwrite=False)
    await fs.rename("/a", "/b", overwrite=True)
    assert (
        fs.commands[0][0:2] == ["sh", "-c"]
        and fs.commands[0][-2:] == ["/a", "/b"]
        and "exit 1" in fs.commands[0][2]
    )
    assert fs.commands[1] == ["mv", "-f", "-T", "--", "/a", "/b"]


# -- open files -------------------------------------------------------------------------------------------------


class FileFs(GuestFs):
    """A GuestFs over one in-memory file: PUT and dd write into it, as the node would."""

    def __init__(self, content: bytes = b"", fail_put: GuestError | None = None) -> None:
        super().__init__(cast(Any, None), "sbx_test")
        self.content = bytearray(content)
        self.calls: list[tuple[str, Any]] = []
        self.fail_put = fail_put

    async def put(self, path: str, chunks: AsyncIterable[bytes]) -> None:
        data = bytearray()
        async for chunk in chunks:
            if self.fail_put is not None:
                raise self.fail_put
            data += chunk
        self.calls.append(("put", len(data)))
        self.content = data

    async def open_writer(self, path: str, offset: int | None) -> Any:
        self.calls.append(("dd", offset))
        return _Dd(self, offset)

    async def setstat(self, path: str, attrs: SetAttrs, follow: bool = True) -> None:
        self.calls.append(("chmod", attrs.permissions))

    async def command(self, argv: Any, cwd: str | None = None) -> bytes:
        self.calls.append(("command", argv[0]))
        return b""


class _Dd:
    def __init__(self, fs: FileFs, offset: int | None) -> None:
        self.fs, self.offset = fs, offset

    async def write(self, data: bytes) -> None:
        content = self.fs.content
        if self.offset is None:
            content += data
            return
        if len(content) < self.offset:
            content += b"\0" * (self.offset - len(content))
        content[self.offset : self.offset + len(data)] = data
        self.offset += len(data)

    async def close(self) -> None:
        self.fs.calls.append(("dd-close", self.offset))

    def abort(self) -> None:
        pass


async def _write_all(writer: Writer, writes: list[tuple[int, bytes]]) -> None:
    for offset, data in writes:
        await writer.write(offset, data)
    await writer.close()


async def test_an_upload_is_one_put() -> None:
    fs = FileFs(b"old contents that are longer")
    await _write_all(Writer(fs, "/f", fresh=True, append=False), [(0, b"abc"), (3, b"def"), (6, b"g")])
    assert fs.content == b"abcdefg" and fs.calls == [("put", 7)]


async def test_an_upload_past_the_put_cap_goes_on_with_dd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handles, "PUT_CAP_BYTES", 10)
    fs = FileFs()
    await _write_all(
        Writer(fs, "/f", fresh=True, append=False), [(0, b"0123456"), (7, b"789abcdef"), (16, b"XY")]
    )
    assert fs.content == b"0123456789abcdefXY"
    assert fs.calls == [("put", 10), ("dd", 10), ("dd-close", 18)]


async def test_writes_out_of_order_go_to_dd_at_their_offset() -> None:
    fs = FileFs(b"0123456789")
    await _write_all(
        Writer(fs, "/f", fresh=False, append=False), [(2, b"ab"), (4, b"cd"), (0, b"Z"), (12, b"!")]
    )
    assert fs.content == b"Z1abcd6789\0\0!"
    assert [c for c in fs.calls if c[0] == "dd"] == [("dd", 2), ("dd", 0), ("dd", 12)]


async def test_a_truncated_file_written_first_past_its_start_is_emptied_first() -> None:
    fs = FileFs(b"old contents")
    await _write_all(Writer(fs, "/f", fresh=True, append=False), [(3, b"new")])
    assert fs.content == b"\0\0\0new" and fs.calls[:2] == [("put", 0), ("dd", 3)]


async def test_a_file_nothing_was_written_to_is_created_or_truncated() -> None:
    fs = FileFs(b"old")
    await Writer(fs, "/f", fresh=True, append=False).close()
    assert fs.content == b"" and fs.calls == [("put", 0)]
    kept = FileFs(b"old")
    await Writer(kept, "/f", fresh=False, append=False).close()
    assert kept.content == b"old" and kept.calls == []


async def test_appends_go_to_the_end() -> None:
    fs = FileFs(b"head")
    await _write_all(Writer(fs, "/f", fresh=False, append=True), [(0, b"-a"), (0, b"-b")])
    assert fs.content == b"head-a-b" and fs.calls[0] == ("dd", None)


@pytest.mark.parametrize(("mode", "chmod"), [(0o100755, [("chmod", 0o100755)]), (0o644, []), (None, [])])
async def test_permissions_are_set_after_the_data(mode: int | None, chmod: list[Any]) -> None:
    fs = FileFs()
    await _write_all(Writer(fs, "/f", fresh=True, append=False, restore_mode=mode), [(0, b"x")])
    assert fs.calls == [("put", 1), *chmod]


async def test_a_refused_upload_fails_the_next_write() -> None:
    fs = FileFs(fail_put=GuestError(errno.EACCES, "permission denied: /f"))
    writer = Writer(fs, "/f", fresh=True, append=False)
    await writer.write(0, b"x")  # queued; the node refuses it meanwhile
    await asyncio.sleep(0)
    with pytest.raises(GuestError) as caught:
        await writer.write(1, b"y")
    assert caught.value.errno == errno.EACCES


class StreamFs(GuestFs):
    def __init__(self, data: bytes) -> None:
        super().__init__(cast(Any, None), "sbx_test")
        self.data = data
        self.ranges: list[tuple[int, int]] = []

    async def open_read(self, path: str) -> Any:
        return _Resp(self.data)

    async def read_range(self, path: str, offset: int, size: int) -> bytes:
        self.ranges.append((offset, size))
        return self.data[offset : offset + size]


class _Resp:
    def __init__(self, data: bytes) -> None:
        self.content = _Content(data)

    def close(self) -> None:
        pass


class _Content:
    def __init__(self, data: bytes) -> None:
        self.stream = io.BytesIO(data)
        self.largest = 0

    async def read(self, n: int) -> bytes:
        self.largest = max(self.largest, n)
        return self.stream.read(min(n, 1000))  # a stream gives what it has: short chunks


async def test_reads_in_order_come_from_the_stream_and_skip_ahead() -> None:
    data = bytes(range(256)) * 100
    fs = StreamFs(data)
    reader = Reader(fs, "/f")
    await reader.open()
    assert await reader.read(0, 3000) == data[:3000]
    assert await reader.read(3000, 10) == data[3000:3010]
    assert await reader.read(20000, 100) == data[20000:20100]  # a resumed download: skipped in the stream
    assert await reader.read(25590, 100) == data[25590:25600]  # short at the end
    assert await reader.read(25600, 100) == b""
    assert await reader.read(30000, 100) == b""
    assert fs.ranges == []
    assert await reader.read(10, 5) == data[10:15]  # behind the stream: dd
    assert fs.ranges == [(10, 5)]


# -- what open(2) would check -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("found", "flags", "create", "truncate", "exclusive", "expected"),
    [
        ([("d", "755", "home")], b"ww", True, True, False, ("fresh", 0o640)),
        ([("d", "755", "home")], b"ww", False, False, False, errno.ENOENT),
        ([("d", "555", "home")], b"rr", True, True, False, errno.EACCES),
        ([("f", "644", "home")], b"ww", True, True, False, errno.ENOTDIR),
        ([("d", "755", "home"), ("f", "751", "f")], b"ww", True, True, False, ("fresh", 0o751)),
        ([("d", "755", "home"), ("f", "751", "f")], b"ww", True, False, False, ("kept", None)),
        ([("d", "755", "home"), ("f", "644", "f")], b"ww", True, True, True, errno.EEXIST),
        ([("d", "755", "home"), ("d", "755", "f")], b"ww", True, True, False, errno.EISDIR),
        ([("d", "755", "home"), ("f", "444", "f")], b"wr", True, True, False, errno.EACCES),
        ([("d", "555", "home"), ("f", "644", "f")], b"rw", True, True, False, ("truncated", None)),
        ([("d", "755", "home"), ("l", "777", "f")], b"ww", True, True, False, ("truncated", None)),
    ],
)
async def test_open_for_write(
    found: list[tuple[str, str, str]],
    flags: bytes,
    create: bool,
    truncate: bool,
    exclusive: bool,
    expected: Any,
) -> None:
    fs = CommandFs([b"".join(_record(*f) for f in found) + flags])
    try:
        writer = await open_for_write(fs, "/home/f", create=create, truncate=truncate, exclusive=exclusive,
                                      append=False, permissions=0o640)  # fmt: skip
    except GuestError as exc:
        assert exc.errno == expected
        return
    kind, mode = expected
    assert writer.fresh is (kind == "fresh") and writer.restore_mode == mode
    truncated = ["truncate", "-s", "0", "--", "/home/f"] in fs.commands
    assert truncated is (kind == "truncated")
    assert fs.commands[0][:2] == ["sh", "-c"] and fs.commands[0][3:6] == ["sh", "/home", "/home/f"]


# -- sessions -----------------------------------------------------------------------------------------------------


def test_safe_env_keeps_only_locale_and_terminal_names() -> None:
    env = {"LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC", "COLORTERM": "truecolor", "LD_PRELOAD": "/x.so",
           "PATH": "/evil", "BASH_ENV": "/x", "LANGUAGE": "x" * 300, "LC_CTYPE": "bad\x1b"}  # fmt: skip
    assert safe_env(env) == {"LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC", "COLORTERM": "truecolor"}


def test_process_requests() -> None:
    shell = process_request(None, "xterm-256color", (132, 43), {"LANG": "C.UTF-8", "FOO": "x"})
    assert shell.argv == list(LOGIN_SHELL) and shell.tty is True and (shell.rows, shell.cols) == (43, 132)
    assert shell.env == {"LANG": "C.UTF-8", "TERM": "xterm-256color"}
    command = process_request("echo $HOME; exit 3", None, (0, 0), {})
    assert command.argv == [*COMMAND_SHELL, "echo $HOME; exit 3"] and command.tty is not True
    unknown = process_request(None, "weird term;rm", (0, 0), {})
    assert unknown.env == {"TERM": "xterm-256color"} and (unknown.rows, unknown.cols) == (24, 80)
    huge = process_request(None, "vt100", (100000, 100000), {})
    assert (huge.rows, huge.cols) == (65535, 65535)


async def test_a_failed_in_place_write_fails_every_later_call() -> None:
    class FailingDd(_Dd):
        async def close(self) -> None:
            raise GuestError(errno.ENOSPC, "dd: error writing '/f': No space left on device")

    class FullFs(FileFs):
        async def open_writer(self, path: str, offset: int | None) -> Any:
            return FailingDd(self, offset)

    writer = Writer(FullFs(b"x"), "/f", fresh=False, append=False)
    await writer.write(0, b"data")
    for call in (writer.flush(), writer.write(4, b"more"), writer.close()):
        with pytest.raises(GuestError) as caught:
            await call
        assert caught.value.errno == errno.ENOSPC  # the close fails too: the data did not all get in


# -- a session whose attach stream breaks --------------------------------------------------------------------


class _Channel:
    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def wait_closed(self) -> None:
        await self.closed.wait()

    def is_closing(self) -> bool:
        return self.closed.is_set()


class _Out:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass


class _In:
    async def read(self, n: int) -> bytes:
        await asyncio.sleep(3600)
        return b""


class _Process:
    def __init__(self) -> None:
        self.channel, self.stdout, self.stderr, self.stdin = _Channel(), _Out(), _Out(), _In()
        self.status: int | None = None

    def exit(self, status: int) -> None:
        self.status = status
        self.channel.closed.set()


def _stream(data: bytes, then: BaseException | None = None) -> tuple[asyncio.StreamReader, Any]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if then is None:
        reader.feed_eof()
    else:
        reader.set_exception(then)
    writer = cast(
        Any, type("W", (), {"write": lambda self, d: None, "drain": _noop, "close": lambda self: None})()
    )
    return reader, writer


async def _noop(self: Any) -> None:
    pass


async def test_a_broken_attach_stream_is_attached_again_without_repeating_output() -> None:
    from sbx.api import frames
    from sbx.gateway.ssh.sessions import Session

    replay = frames.encode_frame(frames.STDOUT, b"hello ") + frames.encode_frame(frames.STDOUT, b"world\n")
    replay += frames.encode_frame(frames.STDERR, b"warn\n") + frames.exit_frame(3)
    streams = [
        _stream(frames.encode_frame(frames.STDOUT, b"hello "), BrokenPipeError()),  # cut: the exit frame lost
        _stream(replay),  # the node replays everything from the start
    ]

    class Client:
        attached = 0

        async def attach(self, sandbox_id: str, pid: int) -> Any:
            Client.attached += 1
            return streams.pop(0)

    process = _Process()
    session = Session(cast(Any, None), cast(Any, process))
    session.node = cast(Any, type("N", (), {"client": Client()})())
    await asyncio.wait_for(session._relay("sbx_x", 7), 10)
    assert Client.attached == 2 and process.status == 3
    assert process.stdout.data == b"hello world\n" and process.stderr.data == b"warn\n"
