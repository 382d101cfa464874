"""SSH public keys as users register them, and the short-lived access tokens: the rules and their messages.

A registered key is one authorized_keys line without options: ``TYPE BASE64 [COMMENT]`` (spec: Gateway-only
endpoints, ``POST /v1/ssh-keys``). Accepted types (:data:`ACCEPTED_TYPES`): ed25519, ECDSA on P-256, P-384 and
P-521, the two security-key types, and RSA of at least :data:`MIN_RSA_BITS` bits. Everything else is refused
with a message saying what to send instead (see :func:`parse_key_line`).

Fingerprints are OpenSSH's SHA256 ones (``SHA256:`` and the unpadded base64 of the SHA-256 of the key blob), as
``ssh-keygen -l`` prints them. Tokens (``sgt_`` and 40 random lowercase letters and digits) are the whole
credential of a token login: only their SHA-256 is stored.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
import string
from dataclasses import dataclass

import asyncssh
from asyncssh.public_key import decode_ssh_public_key

from sbx.api.errors import InvalidRequest

#: Types a registered key may have.
ACCEPTED_TYPES: tuple[str, ...] = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
    "ssh-rsa",
)
#: The smallest RSA modulus accepted, in bits (spec: Limits).
MIN_RSA_BITS = 2048
#: Longest key line accepted, in characters (a 16384-bit RSA key is about 2,800).
MAX_LINE_CHARS = 8192
#: Longest comment kept, in characters.
MAX_COMMENT_CHARS = 256

TOKEN_PREFIX = "sgt_"
_TOKEN_ALPHABET = string.ascii_lowercase + string.digits
_TOKEN_CHARS = 40  # about 206 random bits
_SHOWN = ", ".join(ACCEPTED_TYPES[:-1]) + f" or ssh-rsa of {MIN_RSA_BITS} bits or more"
_EXAMPLE = "e.g. 'ssh-ed25519 AAAAC3Nza... you@laptop' (the contents of ~/.ssh/id_ed25519.pub)"


@dataclass(frozen=True)
class ParsedKey:
    """A key line that passed every rule: its type, blob, fingerprint and the line as it is stored."""

    type: str
    blob: bytes
    fingerprint: str
    comment: str

    @property
    def line(self) -> str:
        """``TYPE BASE64 [COMMENT]`` as stored and listed."""
        data = base64.b64encode(self.blob).decode("ascii")
        return f"{self.type} {data}" + (f" {self.comment}" if self.comment else "")


def fingerprint(blob: bytes) -> str:
    """OpenSSH's SHA256 fingerprint of a public key blob."""
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode("ascii").rstrip("=")
    return f"SHA256:{digest}"


def parse_key_line(text: str) -> ParsedKey:
    """Check one authorized_keys line without options; ``InvalidRequest`` naming what to send instead."""
    stripped = text.strip()
    if not stripped:
        raise InvalidRequest(f"key is empty: send one public key line, {_EXAMPLE}")
    if len(stripped) > MAX_LINE_CHARS:
        raise InvalidRequest(
            f"key is {len(stripped)} characters long; a public key line is at most {MAX_LINE_CHARS}"
        )
    if "PRIVATE KEY" in stripped:
        raise InvalidRequest(
            "this is a private key: send the public key (the .pub file) and keep the private one to yourself"
        )
    lines = [line for line in stripped.splitlines() if line.strip()]
    if len(lines) > 1:
        raise InvalidRequest(f"key holds {len(lines)} lines: register one key per request")
    fields = stripped.split(None, 2)
    key_type = fields[0]
    if key_type.endswith("-cert-v01@openssh.com"):
        raise InvalidRequest(
            f"SSH certificates ({key_type}) are not accepted: register the plain public key it certifies"
        )
    if key_type not in ACCEPTED_TYPES and key_type != "ssh-dss":
        if any(kind in stripped for kind in (*ACCEPTED_TYPES, "ssh-dss")):
            raise InvalidRequest(
                "authorized_keys options (such as command=, from= or no-pty) are not accepted: send the key "
                "alone, TYPE BASE64 [COMMENT]"
            )
        raise InvalidRequest(f"unknown key type {key_type[:64]!r}: send an {_SHOWN} key, {_EXAMPLE}")
    if key_type == "ssh-dss":
        raise InvalidRequest(
            "DSA keys (ssh-dss) are refused: they are 1024 bits at most and OpenSSH has dropped them; make an "
            "ed25519 key with ssh-keygen -t ed25519"
        )
    if len(fields) < 2:
        raise InvalidRequest(f"key has a type but no key data: {_EXAMPLE}")
    comment = fields[2].strip() if len(fields) > 2 else ""
    if len(comment) > MAX_COMMENT_CHARS or not comment.isprintable():
        raise InvalidRequest(
            f"the key's comment must be printable and at most {MAX_COMMENT_CHARS} characters"
        )
    try:
        blob = base64.b64decode(fields[1], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(
            "the key data is not valid base64: copy the whole line of the .pub file"
        ) from None
    _check_blob(key_type, blob)
    return ParsedKey(key_type, blob, fingerprint(blob), comment)


def _check_blob(key_type: str, blob: bytes) -> None:
    """Raise ``InvalidRequest`` unless the blob is a key of ``key_type`` that the rules accept."""
    inner = _blob_type(blob)
    if inner != key_type:
        raise InvalidRequest(
            f"the key data is of type {inner!r} but the line says {key_type!r}: copy the line unchanged"
        )
    try:
        key = decode_ssh_public_key(blob)
    except (asyncssh.KeyImportError, ValueError):
        raise InvalidRequest(f"the key data is not a valid {key_type} public key") from None
    if key_type == "ssh-rsa":
        bits = int(getattr(key.pyca_key, "key_size", 0))
        if bits < MIN_RSA_BITS:
            raise InvalidRequest(
                f"this RSA key has {bits} bits; at least {MIN_RSA_BITS} are needed: make an ed25519 key with "
                "ssh-keygen -t ed25519 (or ssh-keygen -t rsa -b 3072)"
            )


def _blob_type(blob: bytes) -> str:
    """The type string a key blob starts with (an SSH string: uint32 length, bytes)."""
    if len(blob) < 4:
        return ""
    length = int.from_bytes(blob[:4], "big")
    if length > 64 or len(blob) < 4 + length:
        return ""
    return blob[4 : 4 + length].decode("ascii", errors="replace")


def new_token() -> str:
    """A fresh access token (the SSH user name of a token login)."""
    return TOKEN_PREFIX + "".join(secrets.choice(_TOKEN_ALPHABET) for _ in range(_TOKEN_CHARS))


def is_token(name: str) -> bool:
    """Whether an SSH user name has the form of an access token (not whether it is a valid one)."""
    return name.startswith(TOKEN_PREFIX)


def hash_token(token: str) -> str:
    """SHA-256 hex of a token. Tokens carry about 206 random bits, so a fast hash is enough."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()
