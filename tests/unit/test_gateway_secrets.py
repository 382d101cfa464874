"""Tenant secrets at rest (sbx.gateway.secrets): the key file, AES-GCM sealing bound to tenant and name, and the
name and value rules, as tables; a refusal never quotes the value."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag

from sbx.api.errors import InvalidRequest
from sbx.gateway.secrets import (
    KEY_BYTES,
    SecretBox,
    SecretsKeyError,
    check_secret_name,
    check_secret_value,
    load_key,
    new_key_file,
)


def test_a_new_key_file_is_hex_private_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "k"
    new_key_file(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    key = load_key(path)
    assert len(key) == KEY_BYTES and path.read_text().strip() == key.hex()
    with pytest.raises(FileExistsError):
        new_key_file(path)
    assert load_key(path) == key


@pytest.mark.parametrize(
    ("content", "mode", "words"),
    [
        (b"\x01" * 32, 0o600, None),
        (b"ab" * 32 + b"\n", 0o600, None),
        (b"ab" * 31, 0o600, "must hold 32 random bytes or 64 hexadecimal"),
        (b"zz" * 32, 0o600, "must hold 32 random bytes or 64 hexadecimal"),
        (b"ab" * 32, 0o644, "readable by others"),
    ],
)
def test_key_files(tmp_path: Path, content: bytes, mode: int, words: str | None) -> None:
    path = tmp_path / "k"
    path.write_bytes(content)
    os.chmod(path, mode)
    if words is None:
        assert len(load_key(path)) == 32
    else:
        with pytest.raises(SecretsKeyError, match=words):
            load_key(path)
    with pytest.raises(SecretsKeyError, match="cannot read"):
        load_key(tmp_path / "absent")


def test_sealing_is_fresh_each_time_and_bound_to_tenant_and_name() -> None:
    box = SecretBox(b"\x07" * 32)
    nonce1, sealed1 = box.seal("acme", "TOKEN", b"value")
    nonce2, sealed2 = box.seal("acme", "TOKEN", b"value")
    assert nonce1 != nonce2 and sealed1 != sealed2 and b"value" not in sealed1
    assert box.open("acme", "TOKEN", nonce1, sealed1) == b"value"
    for tenant, name in (("beta", "TOKEN"), ("acme", "OTHER")):
        with pytest.raises(InvalidTag):
            box.open(tenant, name, nonce1, sealed1)
    with pytest.raises(InvalidTag):
        SecretBox(b"\x08" * 32).open("acme", "TOKEN", nonce1, sealed1)
    tampered = bytes([sealed1[0] ^ 1]) + sealed1[1:]
    with pytest.raises(InvalidTag):
        box.open("acme", "TOKEN", nonce1, tampered)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("TOKEN", None),
        ("_x1", None),
        ("1X", "not a valid environment variable name"),
        ("A-B", "not a valid environment variable name"),
        ("", "not a valid environment variable name"),
        ("LD_PRELOAD", "reserved"),
        ("IFS", "reserved"),
        ("SBX_ANYTHING", "reserved"),
    ],
)
def test_secret_names(name: str, words: str | None) -> None:
    if words is None:
        assert check_secret_name(name) == name
    else:
        with pytest.raises(InvalidRequest, match=words):
            check_secret_name(name)


@pytest.mark.parametrize(
    ("value", "words"),
    [("x" * 65536, None), ("é" * 32768, None), ("x" * 65537, "at most 65536"), ("é" * 32769, "at most 65536"),
     ("a\x00b", "NUL")],
)  # fmt: skip
def test_secret_values_and_no_echo(value: str, words: str | None) -> None:
    if words is None:
        assert check_secret_value(value) == value.encode()
        return
    with pytest.raises(InvalidRequest, match=words) as caught:
        check_secret_value(value)
    assert value[:8] not in caught.value.message
