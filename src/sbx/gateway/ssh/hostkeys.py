"""The gateway's SSH host keys: made once, kept beside the state file, the same across restarts.

Two keys: ed25519 (what current clients pick) and RSA of 3072 bits (for clients too old for ed25519 or ECDSA).
Files ``STATE.ssh_host_ed25519_key`` and ``STATE.ssh_host_rsa_key`` (OpenSSH private key format, mode 0600,
written atomically) next to the state file ``STATE``, so they are backed up and moved with it. A key file
readable by others stops the gateway, as sshd does: a host key anyone can read lets them pose as the gateway.

On PostgreSQL (several replicas) the keys are the store's (``gateway_files``, :func:`load_shared`): the first
replica makes them, every other loads the same, so a client cannot tell which replica answered. They are sealed
with the secrets key (AES-256-GCM) when the gateway has one; without it the database's access control is what
protects them. A key file in ``--data-dir`` (``gateway.ssh_host_*_key``) is this replica's, and is put into the
store when the store has none (the way over from a gateway that kept them as files).

``GET /v1/ssh`` reports the public halves as OpenSSH lines (``TYPE BASE64``) and the SHA256 fingerprint of the
ed25519 key, which is what a client shows on first connecting.
"""

from __future__ import annotations

import logging
import stat
from dataclasses import dataclass
from pathlib import Path

import asyncssh
from cryptography.exceptions import InvalidTag

from sbx.gateway.secrets import SecretBox
from sbx.gateway.ssh.keys import fingerprint
from sbx.gateway.store import Store
from sbx.statefile import fsync_dir, write_bytes_atomic

#: (file suffix, asyncssh algorithm, key size in bits or None): the keys a gateway serves, in order.
HOST_KEY_KINDS: tuple[tuple[str, str, int | None], ...] = (
    ("ed25519", "ssh-ed25519", None),
    ("rsa", "ssh-rsa", 3072),
)


log = logging.getLogger(__name__)


class HostKeyError(Exception):
    """A host key file cannot be used (unreadable, not a private key, readable by others)."""


@dataclass(frozen=True)
class HostKeys:
    """The loaded host keys, ed25519 first."""

    keys: tuple[asyncssh.SSHKey, ...]

    @property
    def public_lines(self) -> list[str]:
        """Each key as an OpenSSH public key line without comment (``ssh-ed25519 AAAA...``)."""
        return [_public_line(key) for key in self.keys]

    @property
    def fingerprint(self) -> str:
        """The SHA256 fingerprint of the ed25519 key."""
        return fingerprint(self.keys[0].public_data)


def key_path(state_path: Path, suffix: str) -> Path:
    return state_path.with_name(f"{state_path.name}.ssh_host_{suffix}_key")


def load_or_create(state_path: Path) -> HostKeys:
    """The host keys kept beside ``state_path``, generating any that is missing (once)."""
    keys = []
    for suffix, algorithm, bits in HOST_KEY_KINDS:
        path = key_path(state_path, suffix)
        if not path.exists():
            fresh = asyncssh.generate_private_key(algorithm, key_size=bits) if bits else (
                asyncssh.generate_private_key(algorithm)
            )  # fmt: skip
            write_bytes_atomic(path, fresh.export_private_key("openssh"))
            fsync_dir(path.parent)
        keys.append(_load(path))
    return HostKeys(tuple(keys))


def load_shared(store: Store, base: Path, box: SecretBox | None) -> HostKeys:
    """The host keys every replica of ``store`` serves: a key file beside ``base`` when there is one (put into the
    store if it has none of that kind), else the store's, made by the first replica to start (see the module's
    docstring). ``HostKeyError`` when the store's are sealed and ``box`` is missing or another key."""
    keys = []
    for suffix, algorithm, bits in HOST_KEY_KINDS:
        name = f"ssh_host_{suffix}_key"
        path = key_path(base, suffix)
        if path.exists():
            key = _load(path)
            if store.file_get(name) is None:
                _put(store, name, key, box)
            elif _public_line(_stored(store, name, box)) != _public_line(key):
                log.warning("this replica's SSH host key file differs from the one the other replicas share; "
                            "clients will see another host key here", extra={"path": str(path)})  # fmt: skip
            keys.append(key)
            continue
        if store.file_get(name) is None:
            fresh = asyncssh.generate_private_key(algorithm, key_size=bits) if bits else (
                asyncssh.generate_private_key(algorithm)
            )  # fmt: skip
            _put(store, name, fresh, box)  # False: another replica starting together put its own first
        keys.append(_stored(store, name, box))
    return HostKeys(tuple(keys))


def _put(store: Store, name: str, key: asyncssh.SSHKey, box: SecretBox | None) -> None:
    data = key.export_private_key("openssh")
    if box is None:
        store.file_put_new(name, None, data)
    else:
        store.file_put_new(name, *box.seal_file(name, data))


def _stored(store: Store, name: str, box: SecretBox | None) -> asyncssh.SSHKey:
    kept = store.file_get(name)
    assert kept is not None
    nonce, data = kept
    where = f"the SSH host key {name} kept in {store.location}"
    if nonce is not None:
        if box is None:
            raise HostKeyError(
                f"{where} is sealed with a secrets key: start this replica with --secrets-key-file, the same file "
                "as the other replicas"
            )
        try:
            data = box.open_file(name, nonce, data)
        except InvalidTag:
            raise HostKeyError(
                f"{where} cannot be opened with this replica's secrets key: give every replica the same "
                "--secrets-key-file"
            ) from None
    try:
        return asyncssh.import_private_key(data)
    except asyncssh.KeyImportError as exc:
        raise HostKeyError(f"cannot use {where}: {exc}") from exc


def _load(path: Path) -> asyncssh.SSHKey:
    try:
        mode = path.stat().st_mode
        if stat.S_IMODE(mode) & 0o077:
            raise HostKeyError(
                f"the SSH host key {path} is readable by other users (mode {stat.S_IMODE(mode):o}): "
                f"chmod 600 {path}"
            )
        return asyncssh.read_private_key(path)
    except (OSError, asyncssh.KeyImportError) as exc:
        raise HostKeyError(f"cannot use the SSH host key {path}: {exc}") from exc


def _public_line(key: asyncssh.SSHKey) -> str:
    text = key.export_public_key("openssh").decode("ascii").split()
    return f"{text[0]} {text[1]}"
