"""Who may log in over SSH, to which sandbox (spec: Authentication, SSH; docs/ssh.md).

Two ways in:

- **A registered key**: the SSH user name is a sandbox's id or name, looked up among the sandboxes the key's
  owner has in each tenant they registered it for (their own, an organisation's; an owner holding an ``admin``
  key reaches every sandbox, as through the API). A key registered with a ``sandbox`` reaches only that one.
- **A token** (``sgt_...``) as the SSH user name, with no other credential: it names its sandbox and is good
  for logins until ``expires_at``.

Either way the owner must hold an active API key with ``sandbox:ssh`` (or ``admin``) in the tenant, at login
and for as long as the connection stays open (:func:`still_allowed`, run at every revocation and every 30 s).

Each refusal has a ``reason`` (the label of ``sandbox_gateway_ssh_auth_failures_total``) and, where the person
logging in can act on it, a message sent as an SSH authentication banner. A message never says more than a
successful public key query would (an SSH server answers such queries without a signature, so anyone holding a
public key may ask): never who owns a key, which sandboxes exist, or any name but the one asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from sbx.api.errors import Conflict, NotFound
from sbx.gateway.auth import Principal, has_access
from sbx.gateway.ssh.interfaces import LoginSandboxes
from sbx.gateway.ssh.keys import fingerprint, hash_token, is_token
from sbx.gateway.state import SandboxRecord, SshKeyRecord
from sbx.gateway.store import Store

#: The scope an SSH login needs (``admin`` holds it too).
SSH_SCOPE = "sandbox:ssh"

Reason = Literal["unknown_key", "unknown_token", "expired_token", "no_access", "wrong_sandbox"]


class LoginRefused(Exception):
    """A login the rules refuse: ``reason`` for the metric, ``message`` for the person (None: say nothing)."""

    def __init__(self, reason: Reason, message: str | None = None) -> None:
        super().__init__(reason)
        self.reason: Reason = reason
        self.message = message


@dataclass(frozen=True)
class Login:
    """A login the rules accept: the owner, the sandbox, and the credential (an SSH key, or a token)."""

    user: str
    tenant: str
    sandbox: SandboxRecord
    #: The SSH key record used; None for a token login.
    key_id: str | None = None
    fingerprint: str | None = None

    @property
    def credential(self) -> str:
        """How the audit log names the credential: the SSH key's id, or ``token``."""
        return self.key_id if self.key_id is not None else "token"


def login_by_token(store: Store, sandboxes: LoginSandboxes, token: str, now: float | None = None) -> Login:
    """The login a token names; ``LoginRefused`` when unknown, expired, or its owner lost access."""
    record = store.ssh_tokens.get(hash_token(token))
    if record is None:
        raise LoginRefused("unknown_token", "unknown SSH access token: ask for one with sandbox-cli ssh REF")
    if record.expires_at <= (time.time() if now is None else now):
        when = (
            datetime.fromtimestamp(record.expires_at, UTC)
            .isoformat(timespec="seconds")
            .replace("+00:00", "Z")
        )
        raise LoginRefused(
            "expired_token",
            f"this SSH access token expired at {when}: ask for a new one (sandbox-cli ssh REF, or POST "
            "/v1/sandboxes/REF/ssh-access)",
        )
    _check_access(store, record.user, record.tenant)
    try:
        sandbox = sandboxes.resolve(_principal(store, record.user, record.tenant), record.sandbox)
    except (NotFound, Conflict):
        raise LoginRefused("wrong_sandbox", "the sandbox of this SSH access token is gone") from None
    return Login(record.user, record.tenant, sandbox)


def login_by_key(store: Store, sandboxes: LoginSandboxes, username: str, blob: bytes) -> Login:
    """The login of key ``blob`` as ``username`` (a sandbox id or name); ``LoginRefused`` otherwise.

    One key belongs to one person, who may have registered it for several tenants (their own, organisations):
    the name is looked up in each tenant the key reaches and the person still has SSH access in. A name
    matching sandboxes in several is refused (log in by id)."""
    found = fingerprint(blob)
    records = [k for k in list(store.ssh_keys.values()) if k.fingerprint == found]
    if not records or is_token(username):
        raise LoginRefused("unknown_key")
    user = records[0].user  # one person: registering it for another is refused (409)
    allowed = sorted({r.tenant for r in records if has_access(store, user, r.tenant, SSH_SCOPE)})
    if not allowed:
        _check_access(store, user, records[0].tenant, found)
    reached: dict[str, Login] = {}
    for tenant in allowed:
        try:
            sandbox = sandboxes.resolve(_principal(store, user, tenant), username)
        except (NotFound, Conflict):
            continue
        chosen = _reaching([r for r in records if r.tenant == tenant], sandbox)
        if chosen is not None:
            reached.setdefault(sandbox.id, Login(user, tenant, sandbox, chosen.id, found))
    if len(reached) > 1:
        raise LoginRefused(
            "wrong_sandbox",
            f"the name {username[:64]!r} matches sandboxes in several tenants the SSH key {found} is registered for: "
            "log in as the sandbox's id",
        )
    if not reached:
        raise LoginRefused(
            "wrong_sandbox",
            f"the SSH key {found} reaches no sandbox {username[:64]!r}: log in as the id or name of a sandbox of "
            "yours the key is registered for (sandbox-cli ls lists them)",
        )
    return next(iter(reached.values()))


def still_allowed(store: Store, login: Login) -> bool:
    """Whether an open connection of ``login`` may stay: its owner still holds SSH access in the tenant, and
    the SSH key it used is still registered."""
    if login.key_id is not None and login.key_id not in store.ssh_keys:
        return False
    return has_access(store, login.user, login.tenant, SSH_SCOPE)


def _check_access(store: Store, user: str, tenant: str, key: str | None = None) -> None:
    if not has_access(store, user, tenant, SSH_SCOPE):
        whose = f"the owner of the SSH key {key}" if key else "the owner of this SSH access token"
        raise LoginRefused(
            "no_access",
            f"{whose} holds no active API key with the scope {SSH_SCOPE} (or admin) in its tenant: ask an "
            "admin for one",
        )


def _principal(store: Store, user: str, tenant: str) -> Principal:
    """The owner as the sandboxes service sees them: an admin (holding an ``admin`` key in the tenant)
    reaches every sandbox, as through the API."""
    admin = has_access(store, user, tenant, "admin")
    return Principal(user=user, tenant=tenant, key_tenant=tenant, admin=admin)


def _reaching(records: list[SshKeyRecord], sandbox: SandboxRecord) -> SshKeyRecord | None:
    """The record of the key that reaches ``sandbox``: one registered for it, else one for any sandbox."""
    for record in records:
        if record.sandbox == sandbox.id:
            return record
    for record in records:
        if record.sandbox is None:
            return record
    return None
