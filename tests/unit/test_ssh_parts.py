"""The SSH server built from stand-ins of the interfaces it is given (issue 34, docs/architecture.md), with no
gateway and no aiohttp application: a real SQLite store, a stand-in sandbox look-up, nodes, audit list, metrics
and clock, and real asyncssh clients on loopback. Key and token logins accepted or refused, the per-connection
and per-source limits (the source's window on the given clock), what is audited, the access watchers joined and
left, a revocation's sweep, and a login's node reached through the given ``NodeLookup``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from prometheus_client import CollectorRegistry, Counter
from stand_ins import Audit, Clock

from sbx.api.errors import NotFound, Unavailable
from sbx.gateway import keys
from sbx.gateway.auth import Principal
from sbx.gateway.ssh import server as ssh_server
from sbx.gateway.ssh.hostkeys import HostKeys
from sbx.gateway.ssh.keys import fingerprint, hash_token
from sbx.gateway.ssh.server import SshOptions, SshServer
from sbx.gateway.ssh.sessions import FAILED_STATUS
from sbx.gateway.ssh.throttle import LoginLimits
from sbx.gateway.state import SandboxRecord, SshKeyRecord, SshTokenRecord
from sbx.gateway.store.sqlite import SqliteStore

pytestmark = pytest.mark.timeout(60)

T0 = "2026-01-01T00:00:00Z"
ALICE = asyncssh.generate_private_key("ssh-ed25519")
NORA = asyncssh.generate_private_key("ssh-ed25519")  # registered; her owner holds no key with sandbox:ssh
STRANGER = asyncssh.generate_private_key("ssh-ed25519")  # registered by nobody
HOST_KEYS = HostKeys((asyncssh.generate_private_key("ssh-ed25519"),))
SANDBOXES = [
    SandboxRecord("sbx_a1", "alice", "acme", "n1", "box", 1, 512, T0),
    SandboxRecord("sbx_a2", "alice", "acme", "n1", "other", 1, 512, T0),
    SandboxRecord("sbx_b1", "bob", "beta", "n1", "bobs", 1, 512, T0),
    SandboxRecord("sbx_n1", "nora", "acme", "n1", "norabox", 1, 512, T0),
]


@dataclass
class SandboxesStandIn:
    """The sandbox service's look-up (``LoginSandboxes``): an owner's own sandboxes by id or name."""

    asked: list[tuple[str, str, str]] = field(default_factory=list)

    def resolve(self, principal: Principal, ref: str) -> SandboxRecord:
        self.asked.append((principal.user, principal.tenant, ref))
        for rec in SANDBOXES:
            if ref in (rec.id, rec.name) and (rec.user, rec.tenant) == (principal.user, principal.tenant):
                return rec
        raise NotFound(f"no sandbox {ref}")


@dataclass
class TunnelClient:
    """A node client's tunnel to a port of a sandbox: here a connection to ``target`` on loopback."""

    target: tuple[str, int] | None = None
    opened: list[tuple[str, int]] = field(default_factory=list)

    async def tunnel(self, sandbox: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        assert self.target is not None
        self.opened.append((sandbox, port))
        return await asyncio.open_connection(*self.target)


@dataclass
class NodeStandIn:
    client: TunnelClient


@dataclass
class Nodes:
    """``NodeLookup``: the node ``n1`` when it answers, else the gateway's 503."""

    node: NodeStandIn = field(default_factory=lambda: NodeStandIn(TunnelClient()))
    answering: bool = True
    asked: list[tuple[str, str]] = field(default_factory=list)

    def node_for(self, name: str, what: str) -> NodeStandIn:
        self.asked.append((name, what))
        if not self.answering:
            raise Unavailable(f"the node {name!r} holding {what} is not answering; try again later")
        return self.node


class Metrics:
    """``SshMetrics`` on a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ssh_auth_failures = Counter("auth_failures", "", ["reason"], registry=self.registry)
        self.ssh_credentials_refused = Counter("credentials_refused", "", ["reason"], registry=self.registry)
        self.ssh_login_limits = Counter("login_limits", "", ["action"], registry=self.registry)
        self.ssh_counts: Any = None
        self.ssh_sources_refused: Any = None

    def value(self, name: str, label: str, value: str) -> float:
        return self.registry.get_sample_value(f"{name}_total", {label: value}) or 0.0


@dataclass
class Parts:
    store: SqliteStore
    sandboxes: SandboxesStandIn
    nodes: Nodes
    audit: Audit
    metrics: Metrics
    watchers: list[Any]
    clock: Clock
    server: SshServer

    async def login(
        self, username: str, *client_keys: asyncssh.SSHKey, banners: list[str] | None = None
    ) -> asyncssh.SSHClientConnection:
        """A real client's login on loopback, with only ``client_keys`` (None of the user's own files or agent)."""

        class Client(asyncssh.SSHClient):
            def auth_banner_received(self, msg: str, lang: str) -> None:
                if banners is not None:
                    banners.append(msg)

        conn, _ = await asyncssh.create_connection(
            Client, "127.0.0.1", self.server.port, username=username, client_keys=list(client_keys) or None,
            known_hosts=None, config=None, agent_path=None, password=None, kbdint_auth=False,
        )  # fmt: skip
        return conn

    async def settled(self) -> None:
        """Every connection the server holds has ended (its end counted and audited): call once the clients
        are closed."""
        for conn in list(self.server.connections):
            await conn._closed.wait()


async def build(tmp_path: Path, limits: LoginLimits) -> Parts:
    store = SqliteStore.open(tmp_path / "gw.db")
    for user, tenant, scopes in [
        ("alice", "acme", {"sandbox:ssh"}),
        ("bob", "beta", {"sandbox:ssh"}),
        ("nora", "acme", {"sandbox:read"}),
    ]:
        store.add_key(keys.new_key(user, tenant, scopes)[0])
    for kid, user, key in [("ssh_alice", "alice", ALICE), ("ssh_nora", "nora", NORA)]:
        store.add_ssh_key(
            SshKeyRecord(kid, user, "acme", "acme", fingerprint(key.public_data), "k", None, "t")
        )
    for token, expires_at in [("sgt_alice", time.time() + 3600), ("sgt_old", time.time() - 1)]:
        store.add_ssh_token(SshTokenRecord(hash_token(token), "alice", "acme", "sbx_a1", expires_at, "t"))
    sandboxes, nodes, audit, metrics, watchers, clock = (
        SandboxesStandIn(),
        Nodes(),
        Audit(),
        Metrics(),
        [],
        Clock(),
    )
    server = SshServer(
        HOST_KEYS, SshOptions(("127.0.0.1", 0), limits=limits), store=store, sandboxes=sandboxes, nodes=nodes,
        audit=audit, metrics=metrics, watchers=watchers, clock=clock,
    )  # fmt: skip
    await server.start()
    return Parts(store, sandboxes, nodes, audit, metrics, watchers, clock, server)


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[Parts]:
    p = await build(tmp_path, LoginLimits())
    try:
        yield p
    finally:
        await p.server.close()
        p.store.close()


async def closed(conn: asyncssh.SSHClientConnection) -> None:
    conn.close()
    await conn.wait_closed()


# -- logins --------------------------------------------------------------------------------------------------------

#: (SSH user name, the key offered or None for a token login) -> the sandbox and credential of the login, or the
#: reason of its refusal, the credential the refusal is audited for (None: not audited) and its banner's words.
LOGINS = [
    ("box", ALICE, ("sbx_a1", "ssh_alice")),
    ("sbx_a2", ALICE, ("sbx_a2", "ssh_alice")),
    ("sgt_alice", None, ("sbx_a1", "token")),
    ("bobs", ALICE, ("wrong_sandbox", "ssh_alice", "reaches no sandbox 'bobs'")),  # another owner's sandbox
    ("box", STRANGER, ("unknown_key", None, None)),  # no banner: the key is nobody's the gateway knows
    ("norabox", NORA, ("no_access", "ssh_nora", "holds no active API key with the scope sandbox:ssh")),
    ("sgt_old", None, ("expired_token", "token", "this SSH access token expired at")),
    ("sgt_nobody", None, ("unknown_token", None, "unknown SSH access token")),
]


@pytest.mark.parametrize(
    ("username", "key", "expected"), LOGINS, ids=lambda v: v if isinstance(v, str) else None
)
async def test_a_login_is_accepted_or_refused_and_audited(
    parts: Parts, username: str, key: asyncssh.SSHKey | None, expected: tuple[str, str | None, str | None]
) -> None:
    banners: list[str] = []
    offered = () if key is None else (key,)
    if len(expected) == 2:
        sandbox, credential = expected
        conn = await parts.login(username, *offered, banners=banners)
        await closed(conn)
        await parts.settled()
        (entry,) = parts.audit.of("ssh.login")
        assert (entry["result"], entry["target"], entry["key_id"], entry["node"]) == (
            "accepted", sandbox, credential, "n1"
        )  # fmt: skip
        assert entry["user"] == "alice" and entry["tenant"] == "acme"
        assert not [v for v in entry.values() if str(v).startswith("sgt_")]  # a token never in the log
        assert banners == []
        assert parts.metrics.value("auth_failures", "reason", "unknown_key") == 0
        return
    reason, credential, words = expected
    with pytest.raises(asyncssh.PermissionDenied):
        await parts.login(username, *offered, banners=banners)
    await parts.settled()
    refused = parts.audit.of("ssh.login")
    if credential is None:
        assert refused == []
    else:
        assert [(e["result"], e["key_id"], e["reason"]) for e in refused] == [("refused", credential, reason)]
    if words is None:
        assert banners == []
    else:
        (banner,) = banners
        assert banner.startswith("sbx: ") and words in banner
    assert parts.metrics.value("auth_failures", "reason", reason) == 1
    assert parts.metrics.value("credentials_refused", "reason", reason) == 1
    assert parts.server.connections == set()


async def test_a_key_login_asks_the_sandbox_service_for_the_owners_sandbox(parts: Parts) -> None:
    await closed(await parts.login("other", ALICE))
    # Asked for the key's query and again for its signed request: the same owner, tenant and name each time.
    assert set(parts.sandboxes.asked) == {("alice", "acme", "other")}


# -- the limits on tries -------------------------------------------------------------------------------------------


async def test_a_connection_trying_more_credentials_than_allowed_is_disconnected(tmp_path: Path) -> None:
    p = await build(tmp_path, LoginLimits(max_auth_tries=2))
    try:
        others = [asyncssh.generate_private_key("ssh-ed25519") for _ in range(2)]
        with pytest.raises(asyncssh.DisconnectError) as caught:
            await p.login("box", STRANGER, *others)
        assert caught.value.reason == "Too many authentication failures"
        await p.settled()
        assert p.metrics.value("login_limits", "action", "too_many_tries") == 1
        assert (
            p.metrics.value("credentials_refused", "reason", "unknown_key") == 2
        )  # the third was never tried
        assert p.metrics.value("auth_failures", "reason", "unknown_key") == 1  # one connection
    finally:
        await p.server.close()
        p.store.close()


async def test_a_source_refused_for_its_failures_is_let_in_again_once_its_window_passed(
    tmp_path: Path,
) -> None:
    p = await build(tmp_path, LoginLimits(source_failures=2, window_secs=600))
    try:
        with pytest.raises(asyncssh.PermissionDenied):
            await p.login("box", STRANGER)  # the first failure: answered at once
        with pytest.raises(asyncssh.DisconnectError) as caught:
            await p.login("box", STRANGER)  # the last one allowed: the source is refused from now
        assert (
            refused_source(caught.value) == "too many failed logins from 127.0.0.1: try again in 10 minutes"
        )
        assert p.server.metrics.ssh_sources_refused() == 1
        p.clock.now += 599
        with pytest.raises(asyncssh.DisconnectError) as caught:
            await p.login("box", ALICE)  # a good key too, while the source is refused
        assert refused_source(caught.value) == "too many failed logins from 127.0.0.1: try again in 1 s"
        assert p.metrics.value("login_limits", "action", "source_refused") == 2
        assert p.audit.of("ssh.login") == []
        p.clock.now += 1  # the window of the first failure has passed
        assert p.server.metrics.ssh_sources_refused() == 0
        await closed(await p.login("box", ALICE))
        await p.settled()
        assert [e["result"] for e in p.audit.of("ssh.login")] == ["accepted"]
        assert p.metrics.value("login_limits", "action", "delayed") == 0
    finally:
        await p.server.close()
        p.store.close()


def refused_source(exc: asyncssh.DisconnectError) -> str:
    """The reason of a source's refusal as the client got it (asyncssh adds the code it has no class for)."""
    assert exc.code == asyncssh.DISC_HOST_NOT_ALLOWED_TO_CONNECT
    return exc.reason.removesuffix(f" (error {exc.code})")


@dataclass(eq=False)
class Pending:
    """A connection logging in, as the server's registry sees it."""

    source: str
    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize(("sources", "aborted"), [
    (["a", "a"], []),
    (["a", "a", "a"], [0]),  # one source's third closes its oldest
    (["a", "b", "a", "a"], [0]),  # ... never another source's, older
    (["a", "b", "c", "d"], [0]),  # one more than the server's cap closes the oldest of all
])  # fmt: skip
async def test_connections_logging_in_are_capped_per_source_and_in_all(
    parts: Parts, monkeypatch: pytest.MonkeyPatch, sources: list[str], aborted: list[int]
) -> None:
    monkeypatch.setattr(ssh_server, "MAX_UNAUTHENTICATED_PER_SOURCE", 2)
    monkeypatch.setattr(ssh_server, "MAX_UNAUTHENTICATED", 3)
    registry: Any = parts.server  # its registry of connections, given stand-ins of them
    pending = [Pending(source) for source in sources]
    for conn in pending:
        registry.connected(conn)
    assert [i for i, conn in enumerate(pending) if conn.aborted] == aborted
    registry.logged_in(pending[-1])
    registry.connected(Pending("z"))  # a logged-in connection is not counted
    assert [i for i, conn in enumerate(pending) if conn.aborted] == aborted
    for conn in list(parts.server.connections):
        registry.disconnected(conn)


# -- the watchers, the gauges, a revocation --------------------------------------------------------------------------


async def test_the_server_is_a_watcher_while_it_listens_and_sets_the_gauges(tmp_path: Path) -> None:
    p = await build(tmp_path, LoginLimits())
    try:
        assert p.watchers == [p.server]
        assert p.metrics.ssh_counts == p.server.counts and p.metrics.ssh_counts() == (0, 0)
        assert p.metrics.ssh_sources_refused() == 0
        conn = await p.login("box", ALICE)
        assert p.metrics.ssh_counts() == (1, 0)
        await closed(conn)
        await p.settled()
        assert p.metrics.ssh_counts() == (0, 0)
    finally:
        await p.server.close()
        p.store.close()
    assert p.watchers == []
    await p.server.close()  # a second close finds it gone
    assert p.watchers == []


async def test_a_revocation_closes_the_connections_it_ends_and_audits_them(parts: Parts) -> None:
    by_key = await parts.login("box", ALICE)
    by_token = await parts.login("sgt_alice")
    await parts.server.access_changed()  # nothing changed: both stay
    assert len(parts.server.connections) == 2 and parts.audit.of("ssh.revoked") == []
    assert parts.store.remove_ssh_key("ssh_alice")
    await parts.server.access_changed()  # returns once the key's connection has closed
    await by_key.wait_closed()
    (revoked,) = parts.audit.of("ssh.revoked")
    assert (revoked["kind"], revoked["key_id"], revoked["target"], revoked["result"]) == (
        "revocation", "ssh_alice", "sbx_a1", "closed"
    )  # fmt: skip
    assert [c.login.credential for c in parts.server.connections if c.login is not None] == ["token"]
    await closed(by_token)


# -- a login's node ------------------------------------------------------------------------------------------------


async def test_a_forward_reaches_the_sandbox_through_the_given_node_and_is_audited(parts: Parts) -> None:
    async def upper(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write((await reader.read()).upper())
        await writer.drain()
        writer.close()

    echo = await asyncio.start_server(upper, "127.0.0.1", 0)
    parts.nodes.node.client.target = ("127.0.0.1", echo.sockets[0].getsockname()[1])
    try:
        conn = await parts.login("box", ALICE)
        reader, writer = await conn.open_connection("localhost", 8080)
        writer.write(b"ping")
        writer.write_eof()
        assert await reader.read() == b"PING"
        await closed(conn)
    finally:
        echo.close()
        await echo.wait_closed()
    assert parts.nodes.asked == [("n1", "sandbox sbx_a1")]
    assert parts.nodes.node.client.opened == [("sbx_a1", 8080)]
    (entry,) = parts.audit.of("ssh.session")
    assert (entry["session"], entry["port"], entry["key_id"], entry["target"]) == (
        "forward",
        8080,
        "ssh_alice",
        "sbx_a1",
    )


async def test_a_session_whose_node_does_not_answer_fails_saying_why(parts: Parts) -> None:
    parts.nodes.answering = False
    conn = await parts.login("box", ALICE)
    try:
        result = await conn.run("true")
    finally:
        await closed(conn)
    assert result.exit_status == FAILED_STATUS
    assert result.stderr == (
        "sbx: cannot start a process in sbx_a1: the node 'n1' holding sandbox sbx_a1 is not answering; try again "
        "later\r\n"
    )
    assert parts.audit.of("ssh.session") == []  # no process started: no session
