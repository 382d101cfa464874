"""auth.has_access: what services, jobs and SSH hold an owner to (spec: Revocation 2-4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.gateway import keys
from sbx.gateway.auth import has_access
from sbx.gateway.state import MemberRecord, OrgRecord
from sbx.gateway.store import Store
from sbx.gateway.store.sqlite import SqliteStore


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = SqliteStore.open(tmp_path / "gw.db")
    for user, tenant, scopes in [
        ("alice", "acme", {"sandbox:ssh"}),
        ("bob", "acme", {"sandbox:read"}),
        ("root", "", {"admin"}),
    ]:
        s.add_key(keys.new_key(user, tenant, scopes)[0])
    s.add_org(
        OrgRecord("rocket", "t", "alice", "acme"), MemberRecord("rocket", "alice", "acme", "owner", "t")
    )
    return s


@pytest.mark.parametrize(
    ("user", "tenant", "scope", "expected"),
    [
        ("alice", "acme", "sandbox:ssh", True),
        ("alice", "acme", None, True),
        ("alice", "acme", "sandbox:read", False),  # holds a key, not with that scope
        ("bob", "acme", "sandbox:ssh", False),
        ("bob", "acme", None, True),
        ("alice", "rocket", "sandbox:ssh", True),  # a member, through her key of acme
        ("bob", "rocket", None, False),  # not a member
        ("alice", "", None, False),  # no key in the default tenant
        ("root", "anything", "sandbox:ssh", True),  # admin holds every scope, anywhere
        ("carol", "acme", None, False),  # no key at all
    ],
)
def test_has_access(store: Store, user: str, tenant: str, scope: str | None, expected: bool) -> None:
    assert has_access(store, user, tenant, scope) is expected


def test_a_revoked_key_gives_no_access(store: Store) -> None:
    (alice,) = [k for k in store.keys.values() if k.user == "alice"]
    store.revoke_key(alice.id)
    assert not has_access(store, "alice", "acme")
    assert not has_access(store, "alice", "rocket")


def test_a_removed_member_gives_no_access_in_the_organisation(store: Store) -> None:
    store.remove_member("rocket", "alice")
    assert not has_access(store, "alice", "rocket")
    assert has_access(store, "alice", "acme")
