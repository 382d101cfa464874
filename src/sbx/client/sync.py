"""The blocking SDK: the async one, run on a private event loop thread (no second copy of the code).

    from sbx.client.sync import Client

    with Client() as client:                      # same arguments as AsyncClient
        sandbox = client.sandboxes.create(image="python:3.12")
        print(sandbox.run(["echo", "hi"]).stdout)
        proc = sandbox.start_process(["sh", "-c", "echo a; sleep 1; echo b"])
        for event in proc.output():               # an async iterator becomes a plain iterator
            print(event.data)
        sandbox.delete()

Every object the async SDK hands out (sandboxes, files, processes, attachments, tunnels and
their asyncio streams) comes back wrapped: its coroutine methods block until done and return
wrapped results, async iterators become iterators, ``async with`` becomes ``with``. Values
(``RunResult``, ``OutputEvent``, dicts, ...) come back as they are. Errors are the same
``SandboxError`` classes. Calls run one at a time per thread that makes them; the loop thread is
shared by everything one ``Client`` made and stops with ``Client.close()``.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from types import TracebackType
from typing import Any, Self

from sbx.client._admin import Admin
from sbx.client._client import AsyncClient
from sbx.client._images import Images
from sbx.client._ports import Ports
from sbx.client._process import Process
from sbx.client._sandbox import Files, Sandbox, Sandboxes
from sbx.client._ssh import Ssh
from sbx.client._storage import Snapshots, Volumes
from sbx.client._streams import Attachment, Tunnel
from sbx.client._transport import Transport
from sbx.client._workloads import Jobs, Secrets, Services

__all__ = ["Client", "SyncProxy"]

#: Objects handed out wrapped (they have coroutine methods); anything else is a plain value.
_WRAPPED: tuple[type, ...] = (
    AsyncClient,
    Admin,
    Sandboxes,
    Images,
    Snapshots,
    Volumes,
    Ssh,
    Sandbox,
    Files,
    Ports,
    Process,
    Attachment,
    Tunnel,
    Services,
    Jobs,
    Secrets,
    asyncio.StreamReader,
    asyncio.StreamWriter,
)


class _LoopThread:
    """An event loop running forever on its own daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sbx-client-sync", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` on the loop (awaiting its result if awaitable) and return the result."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a sync SDK call was made from inside its own event loop")
        if self.loop.is_closed():
            raise RuntimeError("this sync client is closed")

        async def invoke() -> Any:
            # Even plain methods run on the loop: asyncio objects are not thread-safe.
            result = fn(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        return asyncio.run_coroutine_threadsafe(invoke(), self.loop).result()

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class SyncProxy:
    """A blocking view of one async SDK object; attribute access and calls go through the loop."""

    __slots__ = ("_loop", "_target")

    def __init__(self, target: Any, loop: _LoopThread) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_loop", loop)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if callable(value):
            return _BlockingCall(value, self._loop)
        return _wrap(value, self._loop)

    def __repr__(self) -> str:
        return f"<sync {self._target!r}>"

    def __enter__(self) -> Self:
        if hasattr(self._target, "__aenter__"):
            self._loop.call(self._target.__aenter__)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if hasattr(self._target, "__aexit__"):
            self._loop.call(self._target.__aexit__, exc_type, exc, tb)

    def __iter__(self) -> Iterator[Any]:
        if not hasattr(self._target, "__aiter__"):
            raise TypeError(f"{type(self._target).__name__} is not iterable")
        return _SyncIterator(self._loop.call(self._target.__aiter__), self._loop)


class _BlockingCall:
    """A bound method of a wrapped object, made blocking."""

    def __init__(self, fn: Callable[..., Any], loop: _LoopThread) -> None:
        self._fn = fn
        self._loop = loop
        self.__doc__ = fn.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _wrap(self._loop.call(self._fn, *args, **kwargs), self._loop)


class _SyncIterator(Iterator[Any]):
    """An async iterator stepped from a plain ``for`` loop; ``close()`` ends it early."""

    def __init__(self, source: AsyncIterator[Any], loop: _LoopThread) -> None:
        self._source = source
        self._loop = loop

    def __next__(self) -> Any:
        try:
            return _wrap(self._loop.call(self._source.__anext__), self._loop)
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        """Stop early and release what the iterator holds (its HTTP stream)."""
        aclose = getattr(self._source, "aclose", None)
        if aclose is not None:
            self._loop.call(aclose)


def _wrap(value: Any, loop: _LoopThread) -> Any:
    if isinstance(value, _WRAPPED):
        return SyncProxy(value, loop)
    if isinstance(value, AsyncIterator):
        return _SyncIterator(value, loop)
    if isinstance(value, list) and any(isinstance(v, _WRAPPED) for v in value):
        return [_wrap(v, loop) for v in value]
    return value


class Client(SyncProxy):
    """The blocking ``AsyncClient``: same arguments, same namespaces (``client.sandboxes``, ...).

    ``url`` and ``token`` default to ``SANDBOX_URL`` / ``SANDBOX_TOKEN``, then the local socket;
    ``timeout_secs`` bounds each plain request (default: none). Close it (or use ``with``).
    """

    __slots__ = ()

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_secs: float | None = None,
        transport: Transport | None = None,
    ) -> None:
        loop = _LoopThread()
        try:
            target = loop.call(AsyncClient, url, token, timeout_secs=timeout_secs, transport=transport)
        except BaseException:
            loop.stop()
            raise
        super().__init__(target, loop)

    def close(self) -> None:
        """Close the connections and stop the loop thread."""
        if not self._loop.loop.is_closed():
            try:
                self._loop.call(self._target.aclose)
            finally:
                self._loop.stop()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
