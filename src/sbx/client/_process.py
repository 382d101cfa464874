"""``Process``: a background process in a sandbox (started by ``sandbox.start_process``).

proc = await sandbox.start_process(["python3", "-u", "serve.py"])
async for event in proc.output():       # replayed from the start, follows until exit
    print(event.stream, event.data)
print(proc.exit_code)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING
from urllib.parse import quote

import msgspec

from sbx.api import frames
from sbx.api.codec import convert_answer
from sbx.api.errors import Unavailable
from sbx.api.processes import OutputChunk, OutputExit, SignalRequest
from sbx.api.processes import Process as ProcessInfo
from sbx.client._streams import Attachment

if TYPE_CHECKING:
    from sbx.client._client import AsyncClient


class Process:
    """A process: ``pid`` (the server's handle, not the guest kernel's), ``argv``, ``info``.

    ``exit_code`` is ``None`` while it runs as far as this object knows; ``output()``, ``wait()``
    and ``refresh()`` update it.
    """

    def __init__(self, client: AsyncClient, sandbox_id: str, info: ProcessInfo) -> None:
        self._client = client
        self.sandbox_id = sandbox_id
        self.info = info
        self.pid: int = info.pid
        self._path = f"/v1/sandboxes/{quote(sandbox_id, safe='')}/processes/{self.pid}"

    @property
    def argv(self) -> list[str]:
        """The command as started."""
        return list(self.info.argv)

    @property
    def state(self) -> str:
        """``running`` while it runs, as last read."""
        return self.info.state

    @property
    def exit_code(self) -> int | None:
        """The exit code once known (negative: killed by that signal), else ``None``."""
        return self.info.exit_code

    def __repr__(self) -> str:
        return f"<Process {self.pid} {self.argv!r} state={self.state}>"

    async def refresh(self) -> Process:
        """Fetch the process again into ``info``; returns itself."""
        self.info = await self._client.call("GET", self._path, ProcessInfo)
        return self

    async def output(self) -> AsyncIterator[OutputChunk]:
        """Its output from the beginning, following until it exits; then ``exit_code`` is set.

        Raises ``Unavailable`` if the stream ends without the exit (the server went away).
        """
        async for line in self._client.stream_lines("GET", self._path + "/output"):
            if "exit_code" in line:
                done = convert_answer(line, OutputExit, "output exit line")
                self.info = msgspec.structs.replace(self.info, state="exited", exit_code=done.exit_code)
                return
            yield convert_answer(line, OutputChunk, "output line")
        raise Unavailable(f"the output stream of process {self.pid} ended before the process did")

    async def wait(self) -> int:
        """Wait until it exits and return the exit code (reads and drops the rest of its output)."""
        if self.exit_code is not None:
            return self.exit_code
        async for _ in self.output():
            pass
        assert self.exit_code is not None  # output() returns only after the exit line
        return self.exit_code

    async def write_stdin(self, data: bytes, close: bool = False) -> None:
        """Send ``data`` to its stdin; ``close=True`` closes stdin afterwards (EOF for the process)."""
        params = {"close": "1"} if close else None
        await self._client.request("POST", self._path + "/stdin", data=bytes(data), params=params)

    async def close_stdin(self) -> None:
        """Close its stdin (the process reads EOF)."""
        await self.write_stdin(b"", close=True)

    async def signal(self, name: str) -> None:
        """Send ``INT``, ``TERM``, ``KILL`` or ``HUP`` (a ``SIG`` prefix is accepted)."""
        bare = frames.encode_signal(name).decode("ascii")
        await self._client.request("POST", self._path + "/signal", json=SignalRequest(bare))

    async def kill(self) -> None:
        """Send ``KILL``."""
        await self.signal("KILL")

    async def attach(self) -> Attachment:
        """Attach over ``sbx-stream/1`` (see ``Sandbox.attach``)."""
        reader, writer = await self._client.upgrade(self._path + "/attach", frames.PROTOCOL)
        return Attachment(reader, writer, self.pid)
