"""Wire types of SSH access through a gateway (spec: Gateway-only endpoints, SSH)."""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType


class SshInfo(msgspec.Struct):
    """``GET /v1/ssh``: where the gateway's SSH server listens, its host keys as OpenSSH public key lines
    and the SHA256 fingerprint of its ed25519 key."""

    host: str
    port: int
    host_keys: list[str]
    fingerprint: str


class SshKeyRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/ssh-keys``: one authorized_keys line without options; ``sandbox`` limits it to one."""

    key: str
    sandbox: str | UnsetType = UNSET


class SshKey(msgspec.Struct, kw_only=True):
    id: str
    fingerprint: str
    key: str
    sandbox: str | UnsetType = UNSET
    created: str


class SshKeyList(msgspec.Struct):
    keys: list[SshKey]


class SshAccessRequest(msgspec.Struct):
    """``POST .../ssh-access``: ``ttl_secs`` 0 or absent is 15 minutes, at most 24 hours."""

    ttl_secs: int | UnsetType = UNSET


class SshAccess(msgspec.Struct):
    """A short-lived login: ``user`` (``sgt_...``) is the whole credential, returned once."""

    user: str
    host: str
    port: int
    expires_at: str
    command: str
