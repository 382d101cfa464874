"""The SSH key line rules (what POST /v1/ssh-keys accepts and why it refuses), fingerprints, tokens, host keys."""

from __future__ import annotations

import base64
import stat
import struct
from pathlib import Path

import asyncssh
import pytest

from sbx.api.errors import InvalidRequest
from sbx.gateway.ssh import hostkeys
from sbx.gateway.ssh.keys import fingerprint, hash_token, is_token, new_token, parse_key_line


def _line(algorithm: str, bits: int | None = None, comment: str = "me@host") -> str:
    key = (
        asyncssh.generate_private_key(algorithm, key_size=bits)
        if bits
        else asyncssh.generate_private_key(algorithm)
    )
    text = key.export_public_key("openssh").decode().split()
    return f"{text[0]} {text[1]} {comment}"


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _sk_ed25519() -> str:
    raw = asyncssh.generate_private_key("ssh-ed25519").public_data[-32:]
    blob = _string(b"sk-ssh-ed25519@openssh.com") + _string(raw) + _string(b"ssh:")
    return "sk-ssh-ed25519@openssh.com " + base64.b64encode(blob).decode()


@pytest.mark.parametrize(
    ("algorithm", "bits"),
    [("ssh-ed25519", None), ("ecdsa-sha2-nistp256", None), ("ecdsa-sha2-nistp384", None),
     ("ecdsa-sha2-nistp521", None), ("ssh-rsa", 2048), ("ssh-rsa", 4096)],
)  # fmt: skip
def test_accepted_types(algorithm: str, bits: int | None) -> None:
    line = _line(algorithm, bits)
    parsed = parse_key_line("  " + line + "\n")
    assert parsed.type == algorithm and parsed.line == line and parsed.comment == "me@host"
    assert parsed.fingerprint == asyncssh.import_public_key(line).get_fingerprint("sha256")


def test_security_key_type_accepted_and_a_line_without_comment() -> None:
    parsed = parse_key_line(_sk_ed25519())
    assert parsed.type == "sk-ssh-ed25519@openssh.com" and parsed.comment == ""
    assert parsed.line == _sk_ed25519().split()[0] + " " + base64.b64encode(parsed.blob).decode()


ED = _line("ssh-ed25519")
RSA_1024 = _line("ssh-rsa", 1024)


def _case_id(value: object) -> str | None:
    """The case's text with the random keys' data named: ids must be the same in every process collecting
    them (parallel workers compare their collections)."""
    if not isinstance(value, str):
        return None
    return value.replace(ED.split()[1], "<ed25519>").replace(RSA_1024.split()[1], "<rsa1024>")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "key is empty: send one public key line, e.g. 'ssh-ed25519 AAAAC3Nza... you@laptop' (the contents of ~/.ssh/id_ed25519.pub)"),
        (" \n ", "key is empty: send one public key line, e.g. 'ssh-ed25519 AAAAC3Nza... you@laptop' (the contents of ~/.ssh/id_ed25519.pub)"),
        (RSA_1024, "this RSA key has 1024 bits; at least 2048 are needed: make an ed25519 key with ssh-keygen -t ed25519 (or ssh-keygen -t rsa -b 3072)"),
        ("ssh-dss AAAAB3NzaC1kc3M=", "DSA keys (ssh-dss) are refused: they are 1024 bits at most and OpenSSH has dropped them; make an ed25519 key with ssh-keygen -t ed25519"),
        (f'from="10.0.0.1" {ED}', "authorized_keys options (such as command=, from= or no-pty) are not accepted: send the key alone, TYPE BASE64 [COMMENT]"),
        (f"restrict,no-pty {ED}", "authorized_keys options (such as command=, from= or no-pty) are not accepted: send the key alone, TYPE BASE64 [COMMENT]"),
        (f"{ED}\n{ED}", "key holds 2 lines: register one key per request"),
        ("ssh-rsa-cert-v01@openssh.com AAAA", "SSH certificates (ssh-rsa-cert-v01@openssh.com) are not accepted: register the plain public key it certifies"),
        ("x" * 9000, "key is 9000 characters long; a public key line is at most 8192"),
        ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3Bl\n-----END OPENSSH PRIVATE KEY-----", "this is a private key: send the public key (the .pub file) and keep the private one to yourself"),
        ("ssh-ed25519", "key has a type but no key data: e.g. 'ssh-ed25519 AAAAC3Nza... you@laptop' (the contents of ~/.ssh/id_ed25519.pub)"),
        ("ssh-ed25519 AAAA*", "the key data is not valid base64: copy the whole line of the .pub file"),
        ("ecdsa-sha2-nistp256 " + ED.split()[1], "the key data is of type 'ssh-ed25519' but the line says 'ecdsa-sha2-nistp256': copy the line unchanged"),
        ("ssh-ed25519 " + base64.b64encode(_string(b"ssh-ed25519") + _string(b"short")).decode(), "the key data is not a valid ssh-ed25519 public key"),
        ("ssh-ed25519 " + base64.b64encode(b"\xff\xff\xff\xffjunk").decode(), "the key data is of type '' but the line says 'ssh-ed25519': copy the line unchanged"),
        (ED + " bad\x07comment", "the key's comment must be printable and at most 256 characters"),
        (ED + " " + "c" * 300, "the key's comment must be printable and at most 256 characters"),
    ],
    ids=_case_id,
)  # fmt: skip
def test_refused_lines(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_key_line(text)
    assert caught.value.message == message


def test_unknown_type_names_what_is_accepted() -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_key_line("ssh-xmss@openssh.com AAAA")
    assert caught.value.message.startswith("unknown key type 'ssh-xmss@openssh.com': send an ssh-ed25519, ")
    assert "ssh-rsa of 2048 bits or more" in caught.value.message


def test_fingerprint_is_openssh_sha256() -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    assert fingerprint(key.public_data) == key.get_fingerprint("sha256")


def test_tokens() -> None:
    first, second = new_token(), new_token()
    assert first != second and is_token(first) and not is_token("box")
    assert len(first) == 44 and first[4:].isalnum() and first[4:].islower()
    assert hash_token(first) != first and len(hash_token(first)) == 64 and first not in hash_token(first)


# -- host keys ---------------------------------------------------------------------------------------------


def test_host_keys_are_made_once_private_and_kept(tmp_path: Path) -> None:
    state = tmp_path / "gw.db"
    first = hostkeys.load_or_create(state)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["gw.db.ssh_host_ed25519_key", "gw.db.ssh_host_rsa_key"]
    for name in files:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    again = hostkeys.load_or_create(state)
    assert again.public_lines == first.public_lines and again.fingerprint == first.fingerprint
    assert [line.split()[0] for line in first.public_lines] == ["ssh-ed25519", "ssh-rsa"]
    assert first.fingerprint == first.keys[0].get_fingerprint("sha256")
    assert first.keys[1].pyca_key.key_size == 3072  # type: ignore[attr-defined]


def test_a_host_key_others_can_read_stops_the_gateway(tmp_path: Path) -> None:
    state = tmp_path / "gw.db"
    hostkeys.load_or_create(state)
    path = hostkeys.key_path(state, "rsa")
    path.chmod(0o644)
    with pytest.raises(hostkeys.HostKeyError) as caught:
        hostkeys.load_or_create(state)
    assert str(caught.value) == (
        f"the SSH host key {path} is readable by other users (mode 644): chmod 600 {path}"
    )


def test_a_damaged_host_key_is_named(tmp_path: Path) -> None:
    state = tmp_path / "gw.db"
    path = hostkeys.key_path(state, "ed25519")
    path.write_text("not a key")
    path.chmod(0o600)
    with pytest.raises(hostkeys.HostKeyError) as caught:
        hostkeys.load_or_create(state)
    assert str(caught.value).startswith(f"cannot use the SSH host key {path}: ")
