"""Where the server is, and the one place failures to reach it become the project's errors.

An endpoint is chosen as: the argument, then ``SANDBOX_URL`` / ``SANDBOX_TOKEN``, then the
default unix socket ``/run/sandboxd.sock``. Accepted addresses:

- ``unix:///path/to/sandboxd.sock`` or a bare absolute path: the node's unix socket;
- ``http://host:port`` or ``https://host:port`` (an optional path prefix is kept).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from sbx.api.errors import Internal, InvalidRequest, SandboxError, Unavailable

DEFAULT_SOCKET = "/run/sandboxd.sock"
ENV_URL = "SANDBOX_URL"
ENV_TOKEN = "SANDBOX_TOKEN"
#: Seconds to wait for a connection; the request itself has no overall limit unless asked.
CONNECT_TIMEOUT_SECS = 10.0

#: Query parameters: a mapping, or pairs when a name repeats (``label=k=v`` twice).
Params = Mapping[str, str] | Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Endpoint:
    """A resolved server address: a unix socket path or an http(s) base URL, plus the token."""

    base_url: str
    socket_path: str | None = None
    token: str | None = None

    @property
    def display(self) -> str:
        """The address as a user would write it, for messages."""
        return f"unix://{self.socket_path}" if self.socket_path is not None else self.base_url


def resolve_endpoint(
    url: str | None = None, token: str | None = None, env: Mapping[str, str] | None = None
) -> Endpoint:
    """The endpoint from ``url``/``token``, else ``SANDBOX_URL``/``SANDBOX_TOKEN``, else the default socket.

    An empty string counts as not given. Raises ``InvalidRequest`` naming the accepted forms for
    an address that is neither a unix socket nor http(s).
    """
    environ = os.environ if env is None else env
    address = url or environ.get(ENV_URL) or f"unix://{DEFAULT_SOCKET}"
    secret = token or environ.get(ENV_TOKEN) or None
    if address.startswith("unix:"):
        path = address[len("unix:") :]
        path = path.removeprefix("//")
        if not path:
            raise InvalidRequest(f"{address!r} names no socket: write unix:///path/to/sandboxd.sock")
        return Endpoint(base_url="http://localhost", socket_path=path, token=secret)
    if address.startswith("/"):
        return Endpoint(base_url="http://localhost", socket_path=address, token=secret)
    parts = urlsplit(address)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidRequest(
            f"{address!r} is not a sandboxd address: use unix:///path/to/sandboxd.sock, "
            "http://host:port or https://host:port"
        )
    if parts.query or parts.fragment:
        raise InvalidRequest(f"{address!r}: a server address takes no query or fragment")
    return Endpoint(base_url=address.rstrip("/"), token=secret)


def translate_error(exc: BaseException, endpoint: Endpoint) -> SandboxError:
    """The project's error for a failure to talk to ``endpoint`` (connect, disconnect, timeout).

    The SDK's one translation boundary: every aiohttp or OS error of a request passes here.
    """
    where = endpoint.display
    hint = (
        "start it with `sandboxd` or point SANDBOX_URL (--url) at a running one"
        if endpoint.socket_path is not None
        else "check that sandboxd listens there and SANDBOX_URL (--url) is right"
    )
    # aiohttp wraps the OS error of connecting; raw connections (upgrades) fail with it bare.
    cause = exc.os_error if isinstance(exc, aiohttp.ClientConnectorError) else exc
    if isinstance(cause, PermissionError):
        return Unavailable(
            f"cannot reach sandboxd at {where}: permission denied; run as the user that owns the socket"
        )
    connecting = isinstance(exc, aiohttp.ClientConnectorError | FileNotFoundError | ConnectionRefusedError)
    if connecting and isinstance(cause, OSError):
        return Unavailable(f"cannot reach sandboxd at {where} ({cause.strerror or cause}): {hint}")
    if isinstance(exc, TimeoutError):
        return Unavailable(f"sandboxd at {where} did not answer in time")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return Unavailable(f"sandboxd at {where} closed the connection before answering; it may have stopped")
    if isinstance(exc, aiohttp.ClientError | OSError):
        return Unavailable(f"talking to sandboxd at {where} failed: {exc}")
    return Internal(f"unexpected error talking to sandboxd at {where}: {exc!r}")
