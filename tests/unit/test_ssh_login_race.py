"""A login whose access is revoked while it completes: between the gateway's check of the key and the client's
signature (a round trip) the revocation's sweep sees no login on the connection, so the completion itself must
look again and end it (audited ``ssh.revoked``, as the sweep would have), never leave it open."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sbx.gateway.ssh import server as ssh_server
from sbx.gateway.ssh.auth import Login
from sbx.gateway.ssh.server import SshConnection


class FakeTransport:
    """The asyncssh connection's side: close() ends it at once (connection_lost)."""

    def __init__(self) -> None:
        self.owner: SshConnection | None = None
        self.closed = 0

    def close(self) -> None:
        self.closed += 1
        assert self.owner is not None
        self.owner.connection_lost(None)

    def abort(self) -> None:
        self.close()


def connection(ssh_keys: dict[str, Any]) -> tuple[SshConnection, FakeTransport, list[dict[str, Any]]]:
    audits: list[dict[str, Any]] = []
    audit = SimpleNamespace(record_audit=lambda **e: audits.append(e))
    server: Any = SimpleNamespace(store=SimpleNamespace(ssh_keys=ssh_keys), audit=audit, logged_in=lambda c: None,
                                  disconnected=lambda c: None)  # fmt: skip
    conn = SshConnection(server)
    transport = FakeTransport()
    transport.owner = conn
    conn.conn = transport  # type: ignore[assignment]
    sandbox: Any = SimpleNamespace(id="sbx_1", node="n1")
    conn._candidate = Login("dave", "acme", sandbox, key_id="ssh_1", fingerprint="SHA256:x")
    return conn, transport, audits


async def test_a_key_removed_before_the_login_completed_ends_the_connection() -> None:
    conn, transport, audits = connection(ssh_keys={})  # the key was removed after its check
    conn.auth_completed()
    assert conn._ending is not None
    await conn._ending
    assert transport.closed == 1
    assert [(a["type"], a.get("result")) for a in audits] == [
        ("ssh.login", "accepted"),
        ("ssh.revoked", "closed"),
    ]
    assert audits[1]["key_id"] == "ssh_1" and audits[1]["user"] == "dave"


async def test_a_login_still_allowed_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssh_server.auth, "still_allowed", lambda store, login: True)
    conn, transport, audits = connection(ssh_keys={"ssh_1": object()})
    conn.auth_completed()
    assert conn._ending is None and transport.closed == 0
    assert [a["type"] for a in audits] == ["ssh.login"]
