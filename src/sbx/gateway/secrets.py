"""Tenant secrets (spec: Jobs, agent runs, secrets): values encrypted at rest, handed only to the sandboxes of the
tenant's jobs and services, in their environment.

The key: ``sandbox-gateway serve --secrets-key-file FILE``, 32 random bytes, raw or as 64 hexadecimal characters
(``sandbox-gateway secrets-key new FILE`` makes one). The file must not be readable by group or others. Without it
every secrets endpoint, and any job or service naming a secret, answers 501.

At rest: AES-256-GCM (``cryptography``), a fresh random 96-bit nonce on every write, the tenant and name bound to
the ciphertext as associated data (a row copied to another tenant or name does not decrypt). Values are at most
64 KiB of text without NUL; names are environment variable names that are not reserved. A value is never
returned, logged, audited or put in an error message; it is decrypted only when a sandbox that needs it is made.
"""

from __future__ import annotations

import logging
import os
import secrets as random_source
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sbx.api.errors import InvalidRequest, NotFound, Unsupported
from sbx.api.services import Secret
from sbx.api.validation import is_reserved_env_name, validate_env_name
from sbx.gateway.interfaces import Writes
from sbx.gateway.state import now_rfc3339
from sbx.gateway.store import Delete, Store, Upsert

log = logging.getLogger(__name__)

KEY_BYTES: Final = 32
NONCE_BYTES: Final = 12
#: Largest secret value, in bytes of its UTF-8 text.
MAX_VALUE_BYTES: Final = 64 * 1024
NO_KEY: Final = (
    "this gateway keeps no secrets: start it with --secrets-key-file (make a key with "
    "sandbox-gateway secrets-key new FILE)"
)


class SecretsKeyError(Exception):
    """The secrets key file cannot be used; the message says what to change."""


def load_key(path: Path) -> bytes:
    """The key in ``path``: 32 raw bytes, or 64 hexadecimal characters (surrounding white space ignored)."""
    try:
        info = path.stat()
        data = path.read_bytes()
    except OSError as exc:
        raise SecretsKeyError(f"cannot read the secrets key file {path}: {exc.strerror or exc}") from None
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise SecretsKeyError(f"the secrets key file {path} is readable by others: chmod 600 {path}")
    if len(data) == KEY_BYTES:
        return data
    text = data.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise SecretsKeyError(
        f"the secrets key file {path} holds {len(data)} bytes: it must hold 32 random bytes or 64 hexadecimal "
        "characters (make one with sandbox-gateway secrets-key new FILE)"
    )


def new_key_file(path: Path) -> None:
    """Write a new random key to ``path`` as 64 hexadecimal characters, mode 0600; never overwrites."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (random_source.token_bytes(KEY_BYTES).hex() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def check_secret_name(name: str, field: str = "name") -> str:
    """A secret's name: an environment variable name that is not reserved (400 otherwise)."""
    validate_env_name(name, field)
    if is_reserved_env_name(name):
        raise InvalidRequest(
            f"{field}: {name} is a reserved environment variable name (it controls sandbox start-up, the loader "
            "or the shell) and cannot name a secret; choose another name"
        )
    return name


def check_secret_value(value: str) -> bytes:
    """The value as stored: at most 64 KiB of UTF-8, no NUL (400 otherwise, never quoting it)."""
    if "\x00" in value:
        raise InvalidRequest("value: a secret cannot contain a NUL character (no environment can hold one)")
    data = value.encode("utf-8", "surrogatepass")
    if len(data) > MAX_VALUE_BYTES:
        raise InvalidRequest(f"value: {len(data)} bytes; a secret holds at most {MAX_VALUE_BYTES} bytes")
    return data


class SecretBox:
    """AES-256-GCM with a fresh nonce per value; the tenant and name are its associated data."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError("a secrets key is 32 bytes")
        self._aead = AESGCM(key)

    @staticmethod
    def _bound_to(tenant: str, name: str) -> bytes:
        return b"sbx-secret\x00" + tenant.encode() + b"\x00" + name.encode()

    def seal(self, tenant: str, name: str, value: bytes) -> tuple[bytes, bytes]:
        """``(nonce, ciphertext)`` of ``value``."""
        nonce = random_source.token_bytes(NONCE_BYTES)
        return nonce, self._aead.encrypt(nonce, value, self._bound_to(tenant, name))

    def open(self, tenant: str, name: str, nonce: bytes, ciphertext: bytes) -> bytes:
        """The value; raises ``InvalidTag`` when the key or the row is not the one it was sealed with."""
        return self._aead.decrypt(nonce, ciphertext, self._bound_to(tenant, name))

    def seal_file(self, name: str, data: bytes) -> tuple[bytes, bytes]:
        """``(nonce, ciphertext)`` of one of the gateway's own files (an SSH host key), bound to its name (never
        confused with a tenant's secret: other associated data)."""
        nonce = random_source.token_bytes(NONCE_BYTES)
        return nonce, self._aead.encrypt(nonce, data, b"sbx-gateway-file\x00" + name.encode())

    def open_file(self, name: str, nonce: bytes, ciphertext: bytes) -> bytes:
        """What :meth:`seal_file` sealed; ``InvalidTag`` with another key."""
        return self._aead.decrypt(nonce, ciphertext, b"sbx-gateway-file\x00" + name.encode())


#: The store's file that tells whether a secrets key is the one the store's secrets were sealed with.
KEY_CHECK = "secrets_key_check"


def check_key(store: Store, box: SecretBox, key_file: Path) -> None:
    """Refuse (``SecretsKeyError``) a secrets key that does not open what the store holds sealed: at start, so a
    replica given another key than the others (or a gateway whose key file was changed) stops with the reason
    instead of failing each job and service that needs a secret. The first gateway with a key seals a check value
    in the store (``gateway_files``); a store from before the check is checked against one of its secrets."""
    kept = store.file_get(KEY_CHECK)
    if kept is None:
        rows = store.query("secrets", ("tenant", "name", "nonce", "ciphertext"))
        for tenant, name, nonce, ciphertext in rows[:1]:
            try:
                box.open(str(tenant), str(name), bytes(nonce), bytes(ciphertext))
            except InvalidTag:
                raise SecretsKeyError(_wrong_key(key_file, store)) from None
        store.file_put_new(KEY_CHECK, *box.seal_file(KEY_CHECK, b"sbx secrets key check"))
        kept = store.file_get(KEY_CHECK)  # another replica starting together may have sealed it first
        assert kept is not None
    nonce, data = kept
    try:
        if nonce is None:
            raise InvalidTag
        box.open_file(KEY_CHECK, nonce, data)
    except InvalidTag:
        raise SecretsKeyError(_wrong_key(key_file, store)) from None


def _wrong_key(key_file: Path, store: Store) -> str:
    return (
        f"the secrets key file {key_file} does not open the secrets sealed in {store.location} (another "
        "replica, or this gateway before, sealed them with another key): give every replica the same "
        "--secrets-key-file, the one the secrets were sealed with"
    )


@dataclass(frozen=True)
class _Sealed:
    nonce: bytes
    ciphertext: bytes
    updated: str


class Secrets:
    """The tenants' secrets: sealed rows in the state file, and a copy of them (still sealed) in memory. Given the
    store, its ``Writes`` (a row is written off the event loop) and the box (None: no secrets key)."""

    def __init__(self, writes: Writes, store: Store, box: SecretBox | None) -> None:
        self.writes = writes
        self.store = store
        self.box = box
        self._rows: dict[tuple[str, str], _Sealed] = {}
        # Memory is a copy of the table, kept in step with other replicas' writes (``Store.mirror``).
        store.mirror("secrets", self._put_row, lambda k: self._rows.pop((k[0], k[1]), None),
                     self._rows.clear)  # fmt: skip
        for row in store.query("secrets", ("tenant", "name", "nonce", "ciphertext", "updated")):
            self._put_row(row)

    def _put_row(self, row: tuple[object, ...]) -> None:
        tenant, name, nonce, ciphertext, updated = row
        assert isinstance(nonce, bytes | memoryview) and isinstance(ciphertext, bytes | memoryview)
        self._rows[(str(tenant), str(name))] = _Sealed(bytes(nonce), bytes(ciphertext), str(updated))

    def tenants(self) -> set[str]:
        """Tenants holding a secret (an organisation name may not take one)."""
        return {tenant for tenant, _ in list(self._rows)}

    def require(self) -> SecretBox:
        """The box; 501 when the gateway has no secrets key."""
        if self.box is None:
            raise Unsupported(NO_KEY)
        return self.box

    async def put(self, tenant: str, name: str, value: str) -> None:
        """Set ``name`` in ``tenant`` (400 for a bad name or value; 501 without a key)."""
        box = self.require()
        check_secret_name(name)
        data = check_secret_value(value)
        nonce, ciphertext = box.seal(tenant, name, data)
        updated = now_rfc3339()
        await self.writes.write(self.store.execute, [Upsert("secrets", {
            "tenant": tenant, "name": name, "nonce": nonce, "ciphertext": ciphertext, "updated": updated,
        })])  # fmt: skip
        self._rows[(tenant, name)] = _Sealed(nonce, ciphertext, updated)

    async def delete(self, tenant: str, name: str) -> None:
        """Remove ``name`` from ``tenant``; 404 when it has none (501 without a key)."""
        self.require()
        if (tenant, name) not in self._rows:
            raise NotFound(f"no secret {name!r} in this tenant")
        await self.writes.write(self.store.execute, [Delete("secrets", {"tenant": tenant, "name": name})])
        self._rows.pop((tenant, name), None)

    def listing(self, tenant: str) -> list[Secret]:
        """The tenant's secrets by name, never a value (501 without a key)."""
        self.require()
        return sorted(
            (Secret(name, row.updated) for (t, name), row in list(self._rows.items()) if t == tenant),
            key=lambda s: s.name,
        )

    def check_names(self, tenant: str, names: Iterable[str], field: str = "secrets") -> list[str]:
        """Names a job or service gives: 501 without a key (when any is given), 400 for a malformed, repeated
        or reserved name, or one the tenant does not have."""
        wanted = list(names)
        if not wanted:
            return []
        self.require()
        seen: set[str] = set()
        for i, name in enumerate(wanted):
            check_secret_name(name, f"{field}[{i}]")
            if name in seen:
                raise InvalidRequest(f"{field}[{i}]: {name} is named twice")
            seen.add(name)
            if (tenant, name) not in self._rows:
                raise InvalidRequest(
                    f"{field}[{i}]: this tenant has no secret {name!r}; set it first with PUT /v1/secrets/{name}"
                )
        return wanted

    def values(self, tenant: str, names: Iterable[str]) -> dict[str, str]:
        """The values of ``names`` in ``tenant``, for a sandbox's environment. Raises ``InvalidRequest`` naming a
        secret that is gone or that this gateway's key cannot open (never a value)."""
        found: dict[str, str] = {}
        for name in names:
            row = self._rows.get((tenant, name))
            if row is None:
                raise InvalidRequest(f"the secret {name!r} no longer exists in this tenant; set it again")
            try:
                data = self.require().open(tenant, name, row.nonce, row.ciphertext)
            except InvalidTag:
                raise InvalidRequest(
                    f"the secret {name!r} cannot be opened with this gateway's secrets key (was the key file "
                    "changed?); set it again"
                ) from None
            found[name] = data.decode("utf-8", "surrogatepass")
        return found
