"""Job notifications (spec: Job notifications, Notification URL; docs/jobs.md): a POST to the job's ``notify`` URL
after each run (``run.finished``) and once when the job ends (``job.finished``), body exactly
``{event, job, name?, job_state, run?, state?, exit_code?}``, never output or a value.

Where: ``https`` to a public address. ``--notify-allow-private`` also allows private and loopback addresses, and
plain ``http`` to loopback. Link-local and metadata addresses never. The URL is checked when the job is given
(its form, and an address literal's kind) and again when the gateway connects, against the address actually
dialled (``sbx.net.dial_guard``: a name that resolves elsewhere the second time is refused). Redirects are not
followed. ``--no-notify`` refuses any ``notify`` (501): the gateway then never posts anywhere.

Delivery: from an outbox in the state file, written in the same transaction as the state change it reports, so a
gateway restart loses none; a job's notifications are delivered one after the other, in order. A 2xx answer delivers; a refused address, a 4xx other than 408 and 429, or
:data:`GIVE_UP_SECS` of failures gives up (logged, counted); anything else is tried again after 1, 2, 4 ... 60 s.

Each delivery is a claim of its row (``Store.claim_notifications``), ended in one transaction with the row
deleted or its next try written (``Store.end_claim``). On PostgreSQL a claim is a lease of :data:`LEASE_SECS`
(``FOR UPDATE SKIP LOCKED``; docs/ha.md): a POST ends before its lease, so across a leadership takeover a row is
posted by one worker at a time; a worker dying after the receiver got its POST and before its end has the row
posted again once its lease ends (at-least-once in that one case).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

import aiohttp
import msgspec

from sbx.api.errors import InvalidRequest, Unsupported
from sbx.api.jobs import JobNotification
from sbx.gateway.interfaces import Writes
from sbx.gateway.store import Insert, Store
from sbx.net.dial_guard import AddressRefused, DialGuard, is_loopback_address, refusal_behind
from sbx.net.loopback import is_loopback
from sbx.net.ranges import Address, HostAddresses

log = logging.getLogger(__name__)

MAX_URL_CHARS: Final = 2048
#: Seconds one POST may take.
POST_TIMEOUT_SECS: Final = 10.0
#: Seconds after the first try when a notification is given up.
GIVE_UP_SECS: Final = 15 * 60.0
FIRST_RETRY_SECS: Final = 1.0
MAX_RETRY_SECS: Final = 60.0
#: After the outbox could not be read or written (its database out of reach), the next try comes this late.
STORE_RETRY_SECS: Final = 5.0
#: Notifications posted at once.
CONCURRENT_POSTS: Final = 8
#: How long a claim of an outbox row lasts (on PostgreSQL: a lease written on the row; docs/ha.md): another worker
#: (the next leader) claims a row not ended by then. Longer than a POST plus the write ending the claim.
LEASE_SECS = 60.0
#: A POST ends this long before its lease at the latest, leaving the time to write its end.
LEASE_MARGIN_SECS = 15.0


@dataclass(frozen=True)
class NotifyPolicy:
    """Where notifications may go: ``enabled`` (false with ``--no-notify``), ``allow_private``
    (``--notify-allow-private``)."""

    enabled: bool = True
    allow_private: bool = False


class NotifyRefused(AddressRefused):
    """A notification may not go to this address."""


class NotifyAddresses(DialGuard):
    """The connect-time rule: public addresses always; private and loopback ones with ``allow_private``; over
    plain http (``loopback_only``) loopback only."""

    refusal = NotifyRefused

    def __init__(
        self, allow_private: bool, loopback_only: bool, host_addresses: HostAddresses | None = None
    ) -> None:
        super().__init__(host_addresses)
        self.allow_private = allow_private
        self.loopback_only = loopback_only

    def check(self, host: str, port: int, address: Address) -> None:
        if self.loopback_only:
            if not is_loopback_address(address):
                raise NotifyRefused(f"{host} is at {address}: plain http notifications go to loopback only")
            return
        kind = self.kind(address)
        if kind == "forbidden":
            raise NotifyRefused(f"{host} is at {address}, a link-local, metadata or reserved address")
        if kind == "private" and not self.allow_private:
            raise NotifyRefused(
                f"{host} is at {address}, a private or loopback address (allowed only with --notify-allow-private)"
            )


def check_url(url: str, policy: NotifyPolicy, field: str = "notify") -> str:
    """400 unless ``url`` is one notifications may go to (see the module docstring); 501 with ``--no-notify``."""
    if len(url) > MAX_URL_CHARS or any(ch.isspace() or not ch.isprintable() for ch in url):
        raise InvalidRequest(f"{field}: not a URL (at most {MAX_URL_CHARS} printable characters, no spaces)")
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        parts.port  # noqa: B018 - raises for a malformed port
    except ValueError:
        raise InvalidRequest(f"{field}: {url!r} is not a URL") from None
    if not policy.enabled:
        raise Unsupported(f"{field}: this gateway sends no notifications (it was started with --no-notify)")
    if parts.scheme not in ("https", "http") or not host:
        raise InvalidRequest(f"{field}: give an https URL such as https://hooks.example.com/jobs")
    if parts.username is not None or parts.password is not None:
        raise InvalidRequest(
            f"{field}: a URL with a user or password is not accepted; put a token in its path"
        )
    if parts.fragment:
        raise InvalidRequest(f"{field}: a URL with a #fragment is not accepted")
    if parts.scheme == "http" and not (policy.allow_private and is_loopback(host)):
        raise InvalidRequest(
            f"{field}: use https (plain http is accepted only to loopback on a gateway started with "
            "--notify-allow-private)"
        )
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return url  # a name: judged by the addresses it resolves to, when connecting
    guard = NotifyAddresses(policy.allow_private, parts.scheme == "http")
    try:
        guard.check(host, parts.port or 443, address)
    except NotifyRefused as exc:
        raise InvalidRequest(f"{field}: {exc}") from None
    return url


def body_of(note: JobNotification) -> bytes:
    return msgspec.json.encode(note)


class Notifier:
    """The outbox and its delivery task: ``writes`` ends a claim off the event loop, ``store`` holds the outbox."""

    def __init__(self, writes: Writes, store: Store, policy: NotifyPolicy,
                 count: Callable[[str], None] = lambda result: None) -> None:  # fmt: skip
        self.writes = writes
        self.store = store
        self.policy = policy
        self._count = count
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sessions: dict[bool, aiohttp.ClientSession] = {}
        self._slots = asyncio.Semaphore(CONCURRENT_POSTS)
        #: Names this worker's claims (the outbox's lease owner).
        self.owner = uuid.uuid4().hex

    def statement(self, job: str, url: str, note: JobNotification) -> Insert:
        """The outbox row of ``note`` (written by the caller in the transaction of the change it reports)."""
        now = time.time()
        return Insert("notifications", {"job": job, "url": url, "body": body_of(note).decode(), "attempts": 0,
                                        "first_try": now, "next_try": now})  # fmt: skip

    def wake(self) -> None:
        self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="job-notifications")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for session in self._sessions.values():
            await session.close()

    def _session(self, plain_http: bool) -> aiohttp.ClientSession:
        session = self._sessions.get(plain_http)
        if session is None:
            guard = NotifyAddresses(self.policy.allow_private, loopback_only=plain_http)
            connector = aiohttp.TCPConnector(resolver=guard.resolver(), socket_factory=guard.socket_factory)
            session = self._sessions[plain_http] = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=POST_TIMEOUT_SECS), trust_env=False
            )
        return session

    async def _loop(self) -> None:
        while True:
            try:
                await self._round()
            except Exception as exc:  # noqa: BLE001 - the outbox outlives a database that went away for a while
                log.warning("job notifications: the outbox cannot be used now; trying again",
                            extra={"error": str(exc), "retry_secs": STORE_RETRY_SECS})  # fmt: skip
                await asyncio.sleep(STORE_RETRY_SECS)

    async def _round(self) -> None:
        """Deliver what is due, or wait until something is (or ``wake``)."""
        self._wake.clear()
        due = await asyncio.to_thread(self.store.claim_notifications, self.owner, LEASE_SECS)
        if due:
            await asyncio.gather(*(self._deliver(*row[:6]) for row in due))
            return
        when = await asyncio.to_thread(self.store.next_notification)
        wait = max(when - time.time(), 0.05) if when is not None else None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self._wake.wait()

    async def _deliver(self, row_id: int, url: str, body: str, attempts: int, first_try: float,
                       next_try: float) -> None:  # fmt: skip
        claimed = time.monotonic()
        async with self._slots:
            # The POST ends before the lease does (with a margin for the write ending the claim), so no other
            # worker can claim the row while this one may still deliver it.
            left = LEASE_SECS - LEASE_MARGIN_SECS - (time.monotonic() - claimed)
            if left <= 0:
                return  # waited too long for a slot: the row goes back once the lease ends
            outcome = await self._post(url, body.encode(), min(POST_TIMEOUT_SECS, left))
        if outcome is None:
            self._count("delivered")
            await self._end(row_id, None)
            return
        final, why = outcome
        if final or time.time() - first_try > GIVE_UP_SECS:
            log.warning("job notification given up", extra={"url_host": urlsplit(url).hostname, "error": why,
                                                             "attempts": attempts + 1})  # fmt: skip
            self._count("failed")
            await self._end(row_id, None)
            return
        delay = min(FIRST_RETRY_SECS * 2**attempts, MAX_RETRY_SECS)
        await self._end(row_id, (attempts + 1, time.time() + delay))

    async def _end(self, row_id: int, retry: tuple[int, float] | None) -> None:
        """End this worker's claim of the row (delivered or given up: deleted; else its next try)."""
        if not await self.writes.write(self.store.end_claim, row_id, self.owner, retry):
            log.warning("job notification: its lease had ended and another worker took it; it may be sent "
                        "twice", extra={"notification": row_id})  # fmt: skip

    async def _post(
        self, url: str, body: bytes, timeout_secs: float = POST_TIMEOUT_SECS
    ) -> tuple[bool, str] | None:
        """None when delivered; else (whether to give up now, why). ``timeout_secs``: the whole POST's bound."""
        session = self._session(url.startswith("http://"))
        try:
            async with session.post(
                url, data=body, headers={"Content-Type": "application/json", "User-Agent": "sbx-gateway"},
                allow_redirects=False, timeout=aiohttp.ClientTimeout(total=timeout_secs),
            ) as resp:  # fmt: skip
                await resp.read()
                if 200 <= resp.status < 300:
                    return None
                final = 400 <= resp.status < 500 and resp.status not in (408, 429)
                return final, f"HTTP {resp.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            refused = refusal_behind(exc)
            if refused is not None:
                return True, str(refused)
            if isinstance(exc, aiohttp.ClientConnectorError):
                return False, f"cannot connect ({exc.os_error.strerror or exc.os_error})"
            return False, type(exc).__name__
