"""What the SSH server is given of the rest of the gateway besides the shared interfaces of
``sbx.gateway.interfaces`` (issue 34): the sandbox service's look-up a login makes, the gateway's SSH metrics, and
the list of access watchers it joins while it listens; so a unit test builds the server from stand-ins, without a
gateway (``tests/unit/test_ssh_parts.py``).

The rest is passed as it is: the store (``store.base.Store``: keys, memberships, SSH keys and tokens), and the
shared ``NodeLookup`` (a login's node, for its sessions, sftp and forwards), ``AuditSink`` and ``Clock`` (the
source throttle's window).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prometheus_client import Counter

    from sbx.gateway.auth import Principal
    from sbx.gateway.metrics import GatewayMetrics
    from sbx.gateway.sandboxes import Sandboxes
    from sbx.gateway.state import SandboxRecord


class LoginSandboxes(Protocol):
    """The sandbox a login names, as the API would find it for the owner (``sandboxes.Sandboxes``)."""

    def resolve(self, principal: Principal, ref: str) -> SandboxRecord:
        """``principal``'s sandbox by id or name; ``NotFound`` for one not theirs or absent, ``Conflict`` for a
        name matching several."""


class SshMetrics(Protocol):
    """The gateway's SSH series (``metrics.GatewayMetrics``): the counters the server counts in, and the readers
    of the two gauges, which the server sets when it starts listening."""

    #: Connections that tried and did not log in, by reason.
    ssh_auth_failures: Counter
    #: Each key or token refused, by reason.
    ssh_credentials_refused: Counter
    #: What the login limits did (``delayed``, ``too_many_tries``, ``source_refused``).
    ssh_login_limits: Counter
    #: (open connections, open sessions).
    ssh_counts: Callable[[], tuple[int, int]]
    #: Source addresses refused now.
    ssh_sources_refused: Callable[[], int]


class Watcher(Protocol):
    """Something held to its owners' access (the gateway's ``AccessWatcher``): the SSH server is one."""

    async def access_changed(self) -> None:
        """End what may no longer run, before returning."""


class Watchers(Protocol):
    """The gateway's access watchers (``Gateway.watchers``, a list), told at every change of access: the SSH
    server joins them when it listens and leaves when it closes."""

    def append(self, watcher: Watcher, /) -> None: ...

    def count(self, watcher: Watcher, /) -> int: ...

    def remove(self, watcher: Watcher, /) -> None: ...


if TYPE_CHECKING:

    def _gateway_parts_provide_them(
        s: Sandboxes, m: GatewayMetrics, w: list[Watcher]
    ) -> tuple[LoginSandboxes, SshMetrics, Watchers]:
        """Never run: mypy holds ``Sandboxes``, ``GatewayMetrics`` and a list of watchers to the interfaces here."""
        return s, m, w
