"""``Sandbox``: one sandbox and everything done in it; ``client.sandboxes``: finding and making them.

    sandbox = await client.sandboxes.create(image="python:3.12")    # or Sandbox.create(client, ...)
    result = await sandbox.run(["python3", "-c", "print(1)"])
    await sandbox.files.write("/sandbox/home/a.txt", b"hi")
    await sandbox.delete()

A ``Sandbox`` keeps the server's last answer in ``info`` (the wire type ``sbx.api.sandboxes.Sandbox``);
``refresh()`` fetches it again. Calls address the sandbox by id, so a rename does not break a held object.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import quote

from msgspec import UNSET

from sbx.api import frames
from sbx.api.codec import convert_request
from sbx.api.errors import InvalidRequest
from sbx.api.events import EventList
from sbx.api.files import DirEntry, DirListing
from sbx.api.processes import Process as ProcessInfo
from sbx.api.processes import ProcessList, ProcessRequest, RunRequest, RunResult
from sbx.api.sandboxes import CreateRequest, PatchRequest, SandboxList
from sbx.api.sandboxes import Sandbox as SandboxInfo
from sbx.api.snapshots import ScheduleRequest, Snapshot, SnapshotRequest
from sbx.client._ports import Ports
from sbx.client._process import Process
from sbx.client._streams import Attachment, Tunnel

if TYPE_CHECKING:
    from sbx.client._client import AsyncClient

#: The upgrade token of a tunnel.
TUNNEL_PROTOCOL = "sbx-tunnel/1"


def sandbox_path(ref: str) -> str:
    """``/v1/sandboxes/{ref}`` with ``ref`` quoted, so a name never reaches another route."""
    return "/v1/sandboxes/" + quote(ref, safe="")


class Sandboxes:
    """``client.sandboxes``: create, list, get and delete sandboxes."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, request: CreateRequest | None = None, **fields: Any) -> Sandbox:
        """``POST /v1/sandboxes`` with a ``CreateRequest`` or the spec's create fields as keywords (all
        optional): ``name``, ``image``, ``cpus``, ``memory_mb``, ``disk_mb``, ``env``, ``secret_env`` (environment
        the node keeps in memory only; capability ``secret_env``), ``network``, ``labels``, ``idle_timeout_secs``,
        ``persistent`` (capability ``persistent``: suspended instead of terminated after ``idle_timeout_secs``
        seconds idle, woken by the next call that needs it, stoppable with ``stop()``; needs ``name``, else the
        server answers ``InvalidRequest``), ...; an unknown field or a wrong type is ``InvalidRequest``."""
        body = request if request is not None else convert_request(fields, CreateRequest)
        return Sandbox(self._client, await self._client.call("POST", "/v1/sandboxes", SandboxInfo, json=body))

    async def list(self, labels: Mapping[str, str] | None = None) -> list[Sandbox]:
        """``GET /v1/sandboxes``, newest first; only those carrying every label in ``labels``."""
        params = [("label", f"{key}={value}") for key, value in (labels or {}).items()]
        listing = await self._client.call("GET", "/v1/sandboxes", SandboxList, params=params)
        return [Sandbox(self._client, info) for info in listing.sandboxes]

    async def get(self, ref: str) -> Sandbox:
        """``GET /v1/sandboxes/{ref}``: the sandbox named by id or name."""
        return Sandbox(self._client, await self._client.call("GET", sandbox_path(ref), SandboxInfo))

    async def delete(self, ref: str) -> None:
        """``DELETE /v1/sandboxes/{ref}``: terminate it (idempotent)."""
        await self._client.request("DELETE", sandbox_path(ref))

    async def events(self, ref: str) -> EventList:
        """``GET /v1/sandboxes/{ref}/events`` without looking the sandbox up first: a terminated sandbox the
        server has forgotten is still answered by id (capability ``audit``)."""
        return await self._client.call("GET", sandbox_path(ref) + "/events", EventList)


class Sandbox:
    """One sandbox. ``async with`` deletes it on the way out.

    Attributes: ``id``, ``info`` (the Sandbox object as last answered), ``files`` (``Files``), ``ports``
    (``Ports``: its ports on URLs of their own, through a gateway with capability ``exposed_ports``);
    properties ``name``, ``state``, ``image``, ``labels``, ``persistent`` and ``stopped_reason`` read ``info``.
    """

    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        self._client = client
        self.info = info
        self.id: str = info.id
        self.files = Files(client, self.id)
        self.ports = Ports(client, sandbox_path(self.id))

    @classmethod
    async def create(cls, client: AsyncClient, **fields: Any) -> Sandbox:
        """Create a sandbox: the same as ``client.sandboxes.create(**fields)``."""
        return await client.sandboxes.create(**fields)

    @property
    def name(self) -> str:
        """The sandbox's name, ``""`` when it has none."""
        return self.info.name or ""

    @property
    def state(self) -> str:
        """``pending``, ``running``, ``terminated`` (``suspended`` where supported; ``stopped`` for a persistent
        sandbox stopped by ``stop()`` or by a failure, see ``stopped_reason``), as last read."""
        return self.info.state

    @property
    def persistent(self) -> bool:
        """Whether it was created with ``persistent=True``: suspended, not terminated, when idle."""
        return self.info.persistent

    @property
    def stopped_reason(self) -> str | None:
        """Why it is ``stopped`` (``request``, ``restore_failed``, ``crash``, ``suspend_failed``); ``None``
        unless its state is ``stopped``, as last read."""
        reason = self.info.stopped_reason
        return reason if isinstance(reason, str) else None

    @property
    def image(self) -> str:
        """The image reference it runs."""
        return self.info.image

    @property
    def labels(self) -> dict[str, str]:
        """Its labels (client metadata)."""
        return dict(self.info.labels)

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} state={self.state}>"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.delete()

    @property
    def _path(self) -> str:
        return sandbox_path(self.id)

    async def _call(self, method: str, suffix: str = "", json: Any = None) -> Self:
        """Send a call answered by the Sandbox object; keep that answer in ``info``."""
        self.info = await self._client.call(method, self._path + suffix, SandboxInfo, json=json)
        return self

    async def refresh(self) -> Self:
        """Fetch the sandbox again into ``info``; returns itself."""
        return await self._call("GET")

    async def update(self, **fields: Any) -> Self:
        """``PATCH``: any of ``network``, ``name``, ``labels``, ``idle_timeout_secs``; omitted fields
        stay as they are. Returns itself with ``info`` updated."""
        return await self._call("PATCH", json=convert_request(fields, PatchRequest))

    async def delete(self) -> None:
        """Terminate the sandbox: its processes stop and its disk is discarded (idempotent)."""
        await self._client.request("DELETE", self._path)

    async def suspend(self) -> Self:
        """Save and stop the sandbox (memory, processes, disk kept; capability ``suspend``); Conflict while a
        process runs. Returns itself with ``info`` updated."""
        return await self._call("POST", "/suspend")

    async def resume(self) -> Self:
        """Bring a suspended sandbox back as it was, or start a stopped persistent one from its disk (new
        processes, every file kept; ``Unavailable`` when the node has no room for it now). Returns itself with
        ``info`` updated."""
        return await self._call("POST", "/resume")

    async def stop(self) -> Self:
        """Stop a persistent sandbox (capability ``persistent``): its processes end and its memory is freed;
        disk, volumes, name, labels and network are kept, state ``stopped``. ``Conflict`` for a sandbox that
        is not persistent; stopping a stopped one is fine. ``resume()``, or any call that needs the guest
        (``run``, files, processes, ...), starts it again. Returns itself with ``info`` updated."""
        return await self._call("POST", "/stop")

    async def snapshot(self, kind: str = "memory") -> Snapshot:
        """Take a ``memory`` (everything, processes running) or ``disk`` (files only) snapshot; returns the
        Snapshot. Fork it with ``client.sandboxes.create(snapshot_id=...)``."""
        return await self._client.call(
            "POST", f"{self._path}/snapshots", Snapshot, json=SnapshotRequest(kind)
        )

    async def set_snapshot_schedule(self, every_secs: int, keep: int = 1) -> Self:
        """Snapshot every ``every_secs`` seconds keeping the newest ``keep``; ``every_secs`` 0 stops it."""
        return await self._call("PUT", "/snapshot-schedule", ScheduleRequest(every_secs, keep))

    async def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout_secs: float | None = None,
    ) -> RunResult:
        """Run ``argv`` to completion and return its output (each stream kept up to 8 MiB).

        ``argv`` is executed directly (no shell unless ``argv[0]`` is one); ``env`` is merged over
        the sandbox's own; ``cwd`` defaults to ``/sandbox/home``; ``stdin`` is fed and closed;
        ``timeout_secs`` kills the command after that many seconds (the server's default when
        omitted) and gives ``timed_out=True``, ``exit_code=-1``.
        """
        _check_argv(argv)
        body = RunRequest(
            argv=list(argv), env=_env(env), cwd=_opt(cwd), stdin=_opt(stdin), timeout_secs=_opt(timeout_secs)
        )
        return await self._client.call("POST", self._path + "/run", RunResult, json=body)

    async def start_process(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        tty: bool = False,
        rows: int | None = None,
        cols: int | None = None,
    ) -> Process:
        """Start ``argv`` in the background and return its ``Process`` at once.

        ``tty=True`` runs it on a terminal of ``rows`` x ``cols`` (server defaults 24 x 80) with
        one output stream; ``rows``/``cols`` without ``tty`` is ``InvalidRequest``. ``stdin`` is
        written first (stdin stays open: ``write_stdin`` more, or ``close_stdin``).
        """
        _check_argv(argv)
        if (rows is not None or cols is not None) and not tty:
            raise InvalidRequest("rows and cols size a terminal: pass tty=True as well")
        body = ProcessRequest(
            argv=list(argv), env=_env(env), cwd=_opt(cwd), stdin=_opt(stdin), tty=True if tty else UNSET,
            rows=_opt(rows), cols=_opt(cols),
        )  # fmt: skip
        info = await self._client.call("POST", self._path + "/processes", ProcessInfo, json=body)
        return Process(self._client, self.id, info)

    async def processes(self) -> list[Process]:
        """The sandbox's processes, running and exited."""
        listing = await self._client.call("GET", self._path + "/processes", ProcessList)
        return [Process(self._client, self.id, info) for info in listing.processes]

    async def get_process(self, pid: int) -> Process:
        """The process with server handle ``pid``."""
        info = await self._client.call("GET", f"{self._path}/processes/{int(pid)}", ProcessInfo)
        return Process(self._client, self.id, info)

    async def attach(self, pid: int) -> Attachment:
        """Attach to process ``pid`` (``sbx-stream/1``): its output is replayed from the start.

        Close the ``Attachment`` to detach; the process keeps running.
        """
        reader, writer = await self._client.upgrade(
            f"{self._path}/processes/{int(pid)}/attach", frames.PROTOCOL
        )
        return Attachment(reader, writer, int(pid))

    async def tunnel(self, port: int) -> Tunnel:
        """Open a TCP connection to ``127.0.0.1:port`` inside the sandbox (capability ``tunnel``)."""
        if not 1 <= port <= 65535:
            raise InvalidRequest(f"port {port}: give 1 to 65535")
        reader, writer = await self._client.upgrade(
            self._path + "/tunnel", TUNNEL_PROTOCOL, params={"port": str(port)}
        )
        return Tunnel(reader, writer, port)

    async def events(self) -> EventList:
        """The sandbox's audit events, oldest first (capability ``audit``)."""
        return await self._client.call("GET", self._path + "/events", EventList)


class Files:
    """``sandbox.files``: guest files as the sandbox user. Paths are absolute guest paths."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._path = sandbox_path(sandbox_id)

    async def read(self, path: str) -> bytes:
        """The file's bytes; ``NotFound`` if absent."""
        body = await self._client.request("GET", self._path + "/files", params={"path": path}, raw=True)
        return bytes(body)

    async def read_chunks(self, path: str) -> AsyncGenerator[bytes, None]:
        """The file's bytes chunk by chunk as they arrive (a large file need not fit in memory; stop early to
        read only its start); ``NotFound`` if absent."""
        async for chunk in self._client.stream_bytes("GET", self._path + "/files", params={"path": path}):
            yield chunk

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The file decoded as text (``encoding`` default UTF-8)."""
        return (await self.read(path)).decode(encoding)

    async def write(self, path: str, data: bytes | str) -> None:
        """Write the whole file (parents created); ``str`` is encoded as UTF-8. At most 64 MiB."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        await self._client.request("PUT", self._path + "/files", data=raw, params={"path": path})

    async def list(self, path: str) -> list[DirEntry]:
        """The entries of a guest directory, by name."""
        listing = await self._client.call("GET", self._path + "/dirs", DirListing, params={"path": path})
        return listing.entries

    async def remove(self, path: str) -> None:
        """Remove a file or an empty directory."""
        await self._client.request("DELETE", self._path + "/files", params={"path": path})


def _check_argv(argv: Sequence[str]) -> None:
    if isinstance(argv, str):
        # A lone string would become one argument per character.
        raise InvalidRequest("argv is a list of strings, e.g. ['ls', '-l'], not one string")


def _opt(value: Any) -> Any:
    """UNSET (left out of the request) for an argument not given."""
    return UNSET if value is None else value


def _env(env: Mapping[str, str] | None) -> Any:
    return UNSET if env is None else dict(env)
