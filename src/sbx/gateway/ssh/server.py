"""The gateway's SSH server: logins (``auth.py``), then shells and commands (``sessions.py``), sftp and scp
(``sftp.py``) and local forwards (``forwarding.py``) into the one sandbox a login reaches.

Served with asyncssh from ``sandbox-gateway serve --ssh-listen HOST:PORT``, as a cleanup_ctx of the gateway's
application: it starts after the gateway's own loops and stops before them. It is an ``AccessWatcher`` of the
gateway: at every revocation, member removal or SSH key deletion, and every 30 s, each open connection whose
login is no longer allowed (``auth.still_allowed``) is closed with its sessions and forwards, its processes
hung up, and ``ssh.revoked`` audited, before the call that changed access returns.

What a connection may not do: password, keyboard-interactive or host-based logins (keys and tokens only),
remote forwarding (``ssh -R``), agent and X11 forwarding, forwarding to anything but the sandbox's loopback.
A connection has 30 s to log in (:data:`DEFAULT_LOGIN_TIMEOUT_SECS`); at most :data:`MAX_UNAUTHENTICATED` may be
logging in at once (one more closes the oldest), and at most :data:`MAX_UNAUTHENTICATED_PER_SOURCE` from one
source address (one more closes that source's oldest, so one source's flood does not close another's logins), so
idle connections cannot hold the server's memory. How many credentials a connection and a source may try, and
how a failing source is slowed then refused: ``throttle.py``.

The audit log gets ``ssh.login`` (accepted, or refused when the credential was one the gateway knows),
``ssh.session`` per session channel and forward, and ``ssh.revoked``; entries name the owner, the sandbox, and
the credential (the SSH key's id and fingerprint, or ``token``), never the SSH user name (it may be a token).
asyncssh's own log names the SSH user name, so it is kept at WARNING.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import shlex
import socket
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import asyncssh

from sbx.api.ssh import SshInfo
from sbx.gateway.interfaces import MONOTONIC, AuditSink, Clock, NodeLookup
from sbx.gateway.ssh import auth, throttle
from sbx.gateway.ssh.forwarding import Forward, check_destination
from sbx.gateway.ssh.hostkeys import HostKeys
from sbx.gateway.ssh.interfaces import LoginSandboxes, SshMetrics, Watchers
from sbx.gateway.ssh.keys import fingerprint, is_token
from sbx.gateway.ssh.sessions import Session
from sbx.gateway.ssh.sftp import SandboxSftp
from sbx.gateway.ssh.throttle import LoginLimits, SourceThrottle
from sbx.gateway.store import Store
from sbx.web.serve import listen_backlog

log = logging.getLogger(__name__)

#: Seconds a connection has to log in.
DEFAULT_LOGIN_TIMEOUT_SECS = 30.0
#: Connections logging in at once, at most; one more closes the oldest.
MAX_UNAUTHENTICATED = 64
#: Connections logging in at once from one source (``throttle.source_of``), at most; one more closes its oldest.
MAX_UNAUTHENTICATED_PER_SOURCE = 16
#: Shell and command sessions open at once on one connection (sshd's MaxSessions); each runs a process.
MAX_SESSIONS = 10
#: Forwarded connections open at once on one connection; each holds a tunnel to the node.
MAX_FORWARDS = 64
#: Seconds between keepalives to a silent client; three unanswered close the connection.
KEEPALIVE_SECS = 30.0
#: Seconds a revoked or stopping connection's processes and channels get to end.
CLOSE_TIMEOUT_SECS = 10.0
#: Hosts that mean "every address": the API then reports the host the client called it by.
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})


@dataclass(frozen=True)
class SshOptions:
    """Where the SSH server listens, and where clients are told to connect (``advertise``: ``HOST:PORT`` as
    reachable from clients, when that differs from the listening address)."""

    listen: tuple[str, int]
    advertise: tuple[str, int] | None = None
    login_timeout_secs: float = DEFAULT_LOGIN_TIMEOUT_SECS
    #: Credentials per connection, and failures per source (``throttle.py``).
    limits: LoginLimits = field(default_factory=LoginLimits)


class SshServer:
    """The listening server and its open connections; an ``AccessWatcher`` of the gateway.

    Given (issue 34): the store (logins' keys, tokens and access), the sandbox service's look-up of a login's
    sandbox, the nodes (a login's, for its sessions, files and forwards), the audit log, the gateway's SSH metrics,
    the access watchers it joins while listening, and the clock of the failed logins' window."""

    def __init__(
        self, host_keys: HostKeys, options: SshOptions, *, store: Store, sandboxes: LoginSandboxes,
        nodes: NodeLookup, audit: AuditSink, metrics: SshMetrics, watchers: Watchers, clock: Clock = MONOTONIC,
    ) -> None:  # fmt: skip
        self.host_keys = host_keys
        self.options = options
        self.store = store
        self.sandboxes = sandboxes
        self.nodes = nodes
        self.audit = audit
        self.metrics = metrics
        self.watchers = watchers
        #: Every open connection; those logged in have a ``login``.
        self.connections: set[SshConnection] = set()
        #: Connections not logged in yet, oldest first (a dict keeps insertion order).
        self._logging_in: dict[SshConnection, None] = {}
        #: Failed credentials by source address, and what they mean for the next answer.
        self.throttle = SourceThrottle(options.limits, clock)
        self._acceptor: asyncssh.SSHAcceptor | None = None
        self.port = options.listen[1]

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        logging.getLogger("asyncssh").setLevel(logging.WARNING)  # its INFO lines name SSH users (tokens)
        host, port = self.options.listen
        self._acceptor = await asyncssh.create_server(
            lambda: SshConnection(self), host, port, config=None,
            server_host_keys=list(self.host_keys.keys), server_version="sbx_gateway",
            process_factory=self._session, sftp_factory=self._sftp, allow_scp=True, encoding=None,
            line_editor=False, allow_pty=True, agent_forwarding=False, x11_forwarding=False,
            password_auth=False, kbdint_auth=False, host_based_auth=False, gss_host=None,
            login_timeout=self.options.login_timeout_secs, keepalive_interval=KEEPALIVE_SECS,
            keepalive_count_max=3, backlog=listen_backlog(),  # as the API listeners
        )  # fmt: skip
        self.port = self._acceptor.get_port()
        self.watchers.append(self)
        self.metrics.ssh_counts = self.counts
        self.metrics.ssh_sources_refused = self.throttle.refused_sources
        log.info("SSH server listening", extra={"host": host, "port": self.port})

    async def close(self) -> None:
        """Stop listening, then close every connection (their processes hung up)."""
        if self.watchers.count(self):
            self.watchers.remove(self)
        if self._acceptor is not None:
            self._acceptor.close()
        await asyncio.gather(*(c.end() for c in list(self.connections)), return_exceptions=True)
        if self._acceptor is not None:
            await self._acceptor.wait_closed()

    def _session(self, process: asyncssh.SSHServerProcess[bytes]) -> Awaitable[None]:
        conn = _owner(process.channel)
        conn.session_started()
        session = Session(conn, process)
        if len(conn.sessions) >= MAX_SESSIONS:
            return session.refuse(f"at most {MAX_SESSIONS} sessions may be open on one connection")
        conn.sessions.add(session)

        async def serve() -> None:
            try:
                await session.run()
            except Exception:  # a bug: end the session with a word rather than leave the client waiting
                log.exception("an SSH session failed")
                await session.hangup()
                await session.refuse("the gateway failed this session (see its log)")
            finally:
                conn.sessions.discard(session)

        return serve()

    def _sftp(self, chan: asyncssh.SSHServerChannel[bytes]) -> SandboxSftp:
        conn = _owner(chan)
        conn.session_started()
        sftp = SandboxSftp(conn, chan)
        conn.file_sessions.add(sftp)
        conn.audit_session("scp" if chan.get_command() else "sftp")
        return sftp

    # -- what the API reports ------------------------------------------------------------------

    def address(self, api_host: str | None) -> tuple[str, int]:
        """Where clients connect: ``--ssh-advertise``, else the listening address; a wildcard listening
        address is replaced by the host the API was called by (``api_host``, the request's Host)."""
        if self.options.advertise is not None:
            return self.options.advertise
        host = self.options.listen[0]
        if host in _WILDCARDS and api_host:
            host = api_host
        return host, self.port

    def info(self, api_host: str | None) -> SshInfo:
        host, port = self.address(api_host)
        return SshInfo(host=host, port=port, host_keys=self.host_keys.public_lines,
                       fingerprint=self.host_keys.fingerprint)  # fmt: skip

    def command(self, token: str, api_host: str | None) -> str:
        """A ready ``ssh`` command line for a token login."""
        host, port = self.address(api_host)
        port_args = [] if port == 22 else ["-p", str(port)]
        return shlex.join(["ssh", *port_args, f"{token}@{host}"])

    def counts(self) -> tuple[int, int]:
        """(open connections, open sessions) for the metrics."""
        connections = list(self.connections)
        return len(connections), sum(len(c.sessions) + len(c.file_sessions) for c in connections)

    # -- revocation ----------------------------------------------------------------------------

    async def access_changed(self) -> None:
        """Close every connection whose login may no longer stay, and wait until each has."""
        store = self.store
        ending = [
            c
            for c in list(self.connections)
            if c.login is not None and not auth.still_allowed(store, c.login)
        ]
        await asyncio.gather(*(c.end(revoked=True) for c in ending))

    # -- the connection registry ---------------------------------------------------------------

    def connected(self, conn: SshConnection) -> None:
        self.connections.add(conn)
        self._logging_in[conn] = None
        same = [c for c in self._logging_in if c.source == conn.source]
        while len(same) > MAX_UNAUTHENTICATED_PER_SOURCE:
            oldest = same.pop(0)
            del self._logging_in[oldest]
            oldest.abort()
        while len(self._logging_in) > MAX_UNAUTHENTICATED:
            oldest = next(iter(self._logging_in))
            del self._logging_in[oldest]
            oldest.abort()

    def logged_in(self, conn: SshConnection) -> None:
        self._logging_in.pop(conn, None)

    def disconnected(self, conn: SshConnection) -> None:
        self.connections.discard(conn)
        self._logging_in.pop(conn, None)


class SshConnection(asyncssh.SSHServer):
    """One client connection: its login and what it has open."""

    def __init__(self, server: SshServer) -> None:
        self.server = server
        self.conn: asyncssh.SSHServerConnection | None = None
        #: Set once the client has logged in.
        self.login: auth.Login | None = None
        self.sessions: set[Session] = set()
        #: sftp and scp sessions (no process of their own: each operation is a short one).
        self.file_sessions: set[SandboxSftp] = set()
        self.forwards: set[Forward] = set()
        self._candidate: auth.Login | None = None
        self._refusal: auth.LoginRefused | None = None
        self._refused_credential: str | None = None
        self._tried = False
        #: The client's address, and the source it counts for (``throttle.source_of``).
        self.address = ""
        self.source = ""
        #: Credentials tried on this connection: (user name, key) pairs and tokens (``throttle.py``).
        self._tries: set[tuple[str, bytes]] = set()
        self._closed = asyncio.Event()
        self._banners: set[str] = set()
        #: The end of a login revoked while it completed (kept: a task nobody holds may be collected).
        self._ending: asyncio.Future[None] | None = None

    # -- asyncssh callbacks --------------------------------------------------------------------

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn
        peer = conn.get_extra_info("peername")
        self.address = str(peer[0]) if peer else ""
        self.source = throttle.source_of(self.address)
        self.server.connected(self)
        self._quick_acks(conn)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.disconnected(self)
        if self.login is None and self._tried:
            reason = self._refusal.reason if self._refusal is not None else "unknown_key"
            self.server.metrics.ssh_auth_failures.labels(reason).inc()
            if self._refused_credential is not None:
                self.server.audit.record_audit(kind="ssh", type="ssh.login", key_id=self._refused_credential,
                                               result="refused", reason=reason)  # fmt: skip
        self._closed.set()  # each session hangs its process up as its channel closes

    async def begin_auth(self, username: str) -> bool:
        self._tried = True
        self._candidate = None
        # A refused source is told at its first login request, after the key exchange: a connection closed before
        # would leave the client writing its key exchange into a closed socket, never reading why.
        self._check_source()
        if not is_token(username):
            return True  # a sandbox's id or name: a registered key must follow
        self._try((username, b""))
        try:
            self._candidate = auth.login_by_token(self.server.store, self.server.sandboxes, username)
        except auth.LoginRefused as refusal:
            self._refuse(refusal, "token" if refusal.reason != "unknown_token" else None)
            await self._failed(refusal)
            return True  # no method will do now: the client is told why, then refused
        return False  # the token is the whole credential

    def public_key_auth_supported(self) -> bool:
        return True

    async def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        self._try((username, key.public_data))
        try:
            login = auth.login_by_key(self.server.store, self.server.sandboxes, username, key.public_data)
        except auth.LoginRefused as refusal:
            found = fingerprint(key.public_data)
            known = [k.id for k in list(self.server.store.ssh_keys.values()) if k.fingerprint == found]
            self._refuse(refusal, known[0] if known else None)
            await self._failed(refusal)
            return False
        self._candidate = login  # asyncssh checks the signature next; success follows only for this key
        return True

    def auth_completed(self) -> None:
        login = self._candidate
        if login is None:  # cannot happen: success follows begin_auth or validate_public_key
            self.abort()
            return
        self.login = login
        self.server.logged_in(self)
        self.server.audit.record_audit(
            kind="ssh", type="ssh.login", key_id=login.credential, fingerprint=login.fingerprint, user=login.user,
            tenant=login.tenant or None, target=login.sandbox.id, node=login.sandbox.node, result="accepted",
        )  # fmt: skip
        if not auth.still_allowed(self.server.store, login):
            # Revoked after the key was checked and before its signature came (a client round trip): the
            # revocation's sweep (SshServer.access_changed) found no login here then, so it ends here now.
            self._ending = asyncio.ensure_future(self.end(revoked=True))

    def connection_requested(
        self, dest_host: str, dest_port: int, orig_host: str, orig_port: int
    ) -> Awaitable[Any]:
        check_destination(dest_host, dest_port)
        self.session_started()
        if len(self.forwards) >= MAX_FORWARDS:
            raise asyncssh.ChannelOpenError(
                asyncssh.OPEN_RESOURCE_SHORTAGE, f"at most {MAX_FORWARDS} forwarded connections at once"
            )
        return Forward(self, dest_port).open()

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        return False  # remote forwarding (ssh -R) is not offered

    # -- the limits on tries (throttle.py) -----------------------------------------------------

    def _try(self, attempt: tuple[str, bytes]) -> None:
        """Count a credential about to be checked (the same one again, as a signed request after a key query
        is, does not count twice); a disconnect when the connection or its source may try no more."""
        self._check_source()
        if attempt in self._tries:
            return
        if len(self._tries) >= self.server.options.limits.max_auth_tries:
            self._too_many()  # only after accepted key queries that no signature followed: none failed yet
        self._tries.add(attempt)

    def _check_source(self) -> None:
        """A disconnect saying why when the connection's source is refused now."""
        refused_for = self.server.throttle.refused_for(self.source)
        if refused_for > 0:
            self.server.metrics.ssh_login_limits.labels("source_refused").inc()
            raise asyncssh.DisconnectError(
                asyncssh.DISC_HOST_NOT_ALLOWED_TO_CONNECT, self._source_refused(refused_for)
            )

    async def _failed(self, refusal: auth.LoginRefused) -> None:
        """A credential was refused: count it against the source, then answer late if the source has failed
        often, or disconnect if the connection has tried its last credential or the source may try no more."""
        metrics = self.server.metrics
        metrics.ssh_credentials_refused.labels(refusal.reason).inc()
        delay = self.server.throttle.failed(self.source)
        if self.server.throttle.refused_for(self.source) > 0:  # this failure was the last one allowed
            log.warning(
                "SSH logins refused from a source for too many failures", extra={"source": self.source}
            )
            self._check_source()
        if delay > 0:
            metrics.ssh_login_limits.labels("delayed").inc()
            await asyncio.sleep(delay)
        if len(self._tries) >= self.server.options.limits.max_auth_tries:
            self._too_many()

    def _too_many(self) -> None:
        self.server.metrics.ssh_login_limits.labels("too_many_tries").inc()
        # sshd's words, which people and scripts know ("Received disconnect ...: Too many authentication failures").
        raise asyncssh.DisconnectError(
            asyncssh.DISC_NO_MORE_AUTH_METHODS_AVAILABLE, "Too many authentication failures"
        )

    def _source_refused(self, secs: float) -> str:
        """The reason told to a refused source; rounded up, so that trying again then is never too early."""
        when = f"{math.ceil(secs / 60)} minutes" if secs >= 90 else f"{math.ceil(secs)} s"
        return f"too many failed logins from {self.address}: try again in {when}"

    # -- the gateway's side --------------------------------------------------------------------

    def _quick_acks(self, conn: asyncssh.SSHServerConnection) -> None:
        """Acknowledge every packet of the client's at once until its first session starts.

        OpenSSH's client turns Nagle's algorithm off only once a session starts: before, it holds a packet back
        until its previous one is acknowledged, and Linux delays an acknowledgement by up to 40 ms when it has
        nothing to send. A login waits on that about twice (measured: 120 ms to run ``true``, 35 ms with this).
        TCP_QUICKACK is one-shot, so it is set again on every read of the handshake."""
        sock = conn.get_extra_info("socket")
        if sock is None or not hasattr(socket, "TCP_QUICKACK"):
            return
        received = conn.data_received

        def data_received(data: bytes, datatype: int | None = None) -> None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            received(data, datatype)

        conn.data_received = data_received  # type: ignore[method-assign]

    def session_started(self) -> None:
        """A session or forward began: the client has turned Nagle's algorithm off (see ``_quick_acks``)."""
        if self.conn is not None and "data_received" in vars(self.conn):
            del self.conn.data_received

    def audit_session(self, kind: str, port: int | None = None) -> None:
        login = self.login
        if login is None:
            return
        self.server.audit.record_audit(
            kind="ssh", type="ssh.session", key_id=login.credential, fingerprint=login.fingerprint,
            user=login.user, tenant=login.tenant or None, target=login.sandbox.id, node=login.sandbox.node,
            session=kind, port=port,
        )  # fmt: skip

    def _refuse(self, refusal: auth.LoginRefused, credential: str | None) -> None:
        self._refusal = refusal
        self._refused_credential = credential
        message = refusal.message
        if message is None or message in self._banners or self.conn is None:
            return
        self._banners.add(message)  # each reason once, however many keys the client tries
        with contextlib.suppress(OSError):
            self.conn.send_auth_banner(f"sbx: {message}\r\n")

    def abort(self) -> None:
        if self.conn is not None:
            self.conn.abort()

    async def end(self, revoked: bool = False) -> None:
        """Hang up every process, close the forwards and the connection, and wait for it to go (at most
        ``CLOSE_TIMEOUT_SECS``); audit ``ssh.revoked`` when ``revoked``."""
        login = self.login
        if revoked and login is not None:
            self.server.audit.record_audit(
                kind="revocation", type="ssh.revoked", key_id=login.credential, fingerprint=login.fingerprint,
                user=login.user, tenant=login.tenant or None, target=login.sandbox.id, node=login.sandbox.node,
                result="closed",
            )  # fmt: skip
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_SECS):
                await asyncio.gather(*(s.hangup() for s in list(self.sessions)), return_exceptions=True)
                for forward in list(self.forwards):
                    forward.close()
                if self.conn is not None:
                    self.conn.close()
                await self._closed.wait()
        except TimeoutError:
            log.error("an SSH connection did not close in time; aborting it")
            self.abort()


def _owner(chan: asyncssh.SSHServerChannel[bytes]) -> SshConnection:
    owner = chan.get_connection().get_owner()
    assert isinstance(owner, SshConnection)
    return owner
