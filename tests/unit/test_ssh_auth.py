"""Who may log in over SSH, where (sbx.gateway.ssh.auth), and the records it reads (ssh_keys, ssh_tokens)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, get_args

import asyncssh
import pytest
from sandbox_parts import parts

from sbx.gateway import keys
from sbx.gateway.metrics import SSH_AUTH_FAILURE_REASONS
from sbx.gateway.sandboxes import Sandboxes
from sbx.gateway.ssh import auth
from sbx.gateway.ssh.keys import fingerprint, hash_token
from sbx.gateway.state import MemberRecord, OrgRecord, SandboxRecord, SshKeyRecord, SshTokenRecord
from sbx.gateway.store import Store
from sbx.gateway.store.sqlite import SqliteStore

NOW = 1_800_000_000.0


def _blob() -> bytes:
    return asyncssh.generate_private_key("ssh-ed25519").public_data


ALICE, ALICE_LIMITED, BOB = _blob(), _blob(), _blob()


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = SqliteStore.open(tmp_path / "gw.db")
    for user, tenant, scopes in [
        ("alice", "acme", {"sandbox:ssh", "sandbox:read"}),
        ("bob", "beta", {"sandbox:ssh"}),
        ("nora", "acme", {"sandbox:read"}),
        ("root", "", {"admin"}),
    ]:
        s.add_key(keys.new_key(user, tenant, scopes)[0])
    for sid, user, tenant, name in [
        ("sbx_a1", "alice", "acme", "box"),
        ("sbx_a2", "alice", "acme", "other"),
        ("sbx_b1", "bob", "beta", "box"),
        ("sbx_n1", "nora", "acme", "norabox"),
    ]:
        s.put_sandbox(SandboxRecord(sid, user, tenant, "n1", name, 1, 512, "2026-01-01T00:00:00Z"))
    for kid, user, tenant, blob, sandbox in [
        ("ssh_alice", "alice", "acme", ALICE, None),
        ("ssh_alice_one", "alice", "acme", ALICE_LIMITED, "sbx_a1"),
        ("ssh_bob", "bob", "beta", BOB, None),
        ("ssh_root", "root", "", _ROOT, None),
        ("ssh_nora", "nora", "acme", _NORA, None),
    ]:
        s.add_ssh_key(SshKeyRecord(kid, user, tenant, tenant, fingerprint(blob), "k", sandbox, "t"))
    for token, user, tenant, sandbox, expires in [
        ("sgt_alice", "alice", "acme", "sbx_a1", NOW + 60),
        ("sgt_old", "alice", "acme", "sbx_a1", NOW - 1),
        ("sgt_nora", "nora", "acme", "sbx_n1", NOW + 60),
        ("sgt_gone", "alice", "acme", "sbx_gone", NOW + 60),
    ]:
        s.add_ssh_token(SshTokenRecord(hash_token(token), user, tenant, sandbox, expires, "t"))
    return s


_ROOT, _NORA = _blob(), _blob()
#: Names of the random keys for the cases' ids, which must be the same in every process collecting them
#: (parallel workers compare their collections).
_NAMES = {ALICE: "alice", ALICE_LIMITED: "alice_limited", BOB: "bob", _ROOT: "root", _NORA: "nora"}


def _case_id(value: object) -> str | None:
    return _NAMES.get(value, "unregistered") if isinstance(value, bytes) else None


def _sandboxes(store: Store) -> Sandboxes:
    return parts(store).sandboxes


@pytest.mark.parametrize(
    ("blob", "username", "expected"),
    [
        (ALICE, "box", ("alice", "sbx_a1", "ssh_alice")),
        (ALICE, "sbx_a2", ("alice", "sbx_a2", "ssh_alice")),
        (ALICE, "other", ("alice", "sbx_a2", "ssh_alice")),
        (ALICE_LIMITED, "box", ("alice", "sbx_a1", "ssh_alice_one")),
        (ALICE_LIMITED, "other", "wrong_sandbox"),  # a key limited to one sandbox reaches only that one
        (ALICE, "sbx_b1", "wrong_sandbox"),  # bob's sandbox, by id
        (BOB, "box", ("bob", "sbx_b1", "ssh_bob")),  # the same name, bob's own
        (ALICE, "nothing", "wrong_sandbox"),
        (ALICE, "sgt_alice", "unknown_key"),  # a token as the user name takes no key
        (_blob(), "box", "unknown_key"),
        (_NORA, "norabox", "no_access"),  # nora holds no key with sandbox:ssh
        (_ROOT, "sbx_b1", ("root", "sbx_b1", "ssh_root")),  # an admin reaches every sandbox
    ],
    ids=_case_id,
)
def test_key_logins(store: Store, blob: bytes, username: str, expected: Any) -> None:
    if isinstance(expected, str):
        with pytest.raises(auth.LoginRefused) as caught:
            auth.login_by_key(store, _sandboxes(store), username, blob)
        assert caught.value.reason == expected
        return
    login = auth.login_by_key(store, _sandboxes(store), username, blob)
    assert (login.user, login.sandbox.id, login.key_id) == expected
    assert login.fingerprint == fingerprint(blob) and login.credential == expected[2]


def test_one_key_for_the_own_tenant_and_an_organisation(store: Store) -> None:
    both = _blob()
    store.add_org(
        OrgRecord("rocket", "t", "alice", "acme"), MemberRecord("rocket", "alice", "acme", "owner", "t")
    )
    for sid, name in [("sbx_r1", "box"), ("sbx_r2", "orgonly")]:
        store.put_sandbox(SandboxRecord(sid, "alice", "rocket", "n1", name, 1, 512, "2026-01-01T00:00:00Z"))
    for kid, tenant in [("ssh_home", "acme"), ("ssh_org", "rocket")]:
        store.add_ssh_key(SshKeyRecord(kid, "alice", "acme", tenant, fingerprint(both), "k", None, "t"))
    sandboxes = _sandboxes(store)
    org = auth.login_by_key(store, sandboxes, "orgonly", both)
    assert (org.tenant, org.sandbox.id, org.key_id) == ("rocket", "sbx_r2", "ssh_org")
    home = auth.login_by_key(store, sandboxes, "other", both)
    assert (home.tenant, home.sandbox.id, home.key_id) == ("acme", "sbx_a2", "ssh_home")
    with pytest.raises(auth.LoginRefused) as caught:
        auth.login_by_key(store, sandboxes, "box", both)  # a name in both tenants: by id only
    assert caught.value.reason == "wrong_sandbox" and "log in as the sandbox's id" in (
        caught.value.message or ""
    )
    assert auth.login_by_key(store, sandboxes, "sbx_r1", both).tenant == "rocket"
    store.remove_member("rocket", "alice")
    assert not auth.still_allowed(store, org) and auth.still_allowed(store, home)
    assert auth.login_by_key(store, sandboxes, "box", both).sandbox.id == "sbx_a1"  # no longer ambiguous
    with pytest.raises(auth.LoginRefused) as caught:
        auth.login_by_key(store, sandboxes, "orgonly", both)
    assert caught.value.reason == "wrong_sandbox"


def test_refusal_messages_say_no_more_than_the_name_asked_for(store: Store) -> None:
    with pytest.raises(auth.LoginRefused) as caught:
        auth.login_by_key(store, _sandboxes(store), "sbx_b1", ALICE)
    assert caught.value.message == (
        f"the SSH key {fingerprint(ALICE)} reaches no sandbox 'sbx_b1': log in as the id or name of a sandbox of "
        "yours the key is registered for (sandbox-cli ls lists them)"
    )
    with pytest.raises(auth.LoginRefused) as caught:
        auth.login_by_key(store, _sandboxes(store), "box", _blob())
    assert caught.value.message is None  # an unknown key: the client may have others to try


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("sgt_alice", ("alice", "sbx_a1")),
        ("sgt_old", "expired_token"),
        ("sgt_nora", "no_access"),
        ("sgt_gone", "wrong_sandbox"),
        ("sgt_unknown", "unknown_token"),
    ],
)
def test_token_logins(store: Store, token: str, expected: Any) -> None:
    if isinstance(expected, str):
        with pytest.raises(auth.LoginRefused) as caught:
            auth.login_by_token(store, _sandboxes(store), token, now=NOW)
        assert caught.value.reason == expected and caught.value.message
        return
    login = auth.login_by_token(store, _sandboxes(store), token, now=NOW)
    assert (login.user, login.sandbox.id, login.key_id, login.credential) == (*expected, None, "token")


def test_expired_message_names_the_time(store: Store) -> None:
    with pytest.raises(auth.LoginRefused) as caught:
        auth.login_by_token(store, _sandboxes(store), "sgt_old", now=NOW)
    assert caught.value.message is not None
    assert caught.value.message.startswith(
        "this SSH access token expired at 2027-01-15T07:59:59Z: ask for a new one"
    )


def test_still_allowed_follows_keys_scopes_and_the_ssh_key(store: Store) -> None:
    login = auth.login_by_key(store, _sandboxes(store), "box", ALICE)
    token = auth.login_by_token(store, _sandboxes(store), "sgt_alice", now=NOW)
    assert auth.still_allowed(store, login) and auth.still_allowed(store, token)
    store.remove_ssh_key("ssh_alice")
    assert not auth.still_allowed(store, login) and auth.still_allowed(store, token)
    (alice,) = [k for k in store.keys.values() if k.user == "alice"]
    store.revoke_key(alice.id)
    assert not auth.still_allowed(store, token)  # a token login is held to the same check


def test_ssh_records_survive_reopen_and_tokens_are_forgotten(store: Store, tmp_path: Path) -> None:
    store.forget_ssh_tokens([hash_token("sgt_old"), "not-a-hash"])
    assert store.remove_ssh_key("ssh_bob") and not store.remove_ssh_key("ssh_bob")
    store.close()
    again = SqliteStore.open(tmp_path / "gw.db")
    assert sorted(again.ssh_keys) == ["ssh_alice", "ssh_alice_one", "ssh_nora", "ssh_root"]
    assert again.ssh_keys["ssh_alice_one"].sandbox == "sbx_a1"
    assert hash_token("sgt_old") not in again.ssh_tokens and hash_token("sgt_alice") in again.ssh_tokens
    assert again.ssh_tokens[hash_token("sgt_alice")].expires_at == NOW + 60
    raw = (tmp_path / "gw.db").read_bytes() + (tmp_path / "gw.db-wal").read_bytes()
    assert b"sgt_alice" not in raw  # only hashes are stored


def test_failure_reasons_are_the_metric_labels() -> None:
    assert get_args(auth.Reason) == SSH_AUTH_FAILURE_REASONS


def test_wall_clock_is_used_without_now(store: Store) -> None:
    store.add_ssh_token(
        SshTokenRecord(hash_token("sgt_now"), "alice", "acme", "sbx_a1", time.time() + 5, "t")
    )
    assert auth.login_by_token(store, _sandboxes(store), "sgt_now").sandbox.id == "sbx_a1"
