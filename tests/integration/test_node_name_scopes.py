"""Names on one node are unique per gateway owner: sandboxes whose ``gateway.owner``/``gateway.tenant`` labels
differ may share a name, and a name ref matching more than one live sandbox is 409 naming the ids."""

from __future__ import annotations

from typing import Any

import pytest
from sandboxd_harness import Sandboxd

OWNER = "gateway.owner"
TENANT = "gateway.tenant"


def listing(sandboxd: Sandboxd) -> list[dict[str, Any]]:
    return sandboxd.request("GET", "/v1/sandboxes").json()["sandboxes"]  # type: ignore[no-any-return]


@pytest.fixture
def shared(sandboxd: Sandboxd) -> Any:
    """Two live sandboxes named ``web``, of gateway users alice and bob, and a plain one named ``web`` too."""
    made = [
        sandboxd.create(name="web", labels={OWNER: "alice"}),
        sandboxd.create(name="web", labels={OWNER: "bob"}),
        sandboxd.create(name="web"),
    ]
    yield made
    for s in made:
        sandboxd.request("DELETE", f"/v1/sandboxes/{s['id']}")


# (labels of the create, status): the name ``web`` is taken in exactly the scopes of the fixture.
CREATE_CASES = [
    ({OWNER: "alice"}, 409),
    ({OWNER: "bob", "team": "x"}, 409),  # other labels do not matter
    ({}, 409),  # plain node users share one scope
    ({OWNER: "carol"}, 201),
    ({OWNER: "alice", TENANT: "acme"}, 201),  # the same user name in another tenant
    ({TENANT: "acme"}, 201),
]


@pytest.mark.parametrize(("labels", "status"), CREATE_CASES)
def test_create_name_is_unique_per_owner_scope(
    sandboxd: Sandboxd, shared: list[dict[str, Any]], labels: dict[str, str], status: int
) -> None:
    before = listing(sandboxd)
    resp = sandboxd.request("POST", "/v1/sandboxes", {"name": "web", "labels": labels})
    try:
        assert resp.status == status, resp.body
        if status == 409:
            assert resp.error == (
                "conflict",
                "the name 'web' is in use by a live sandbox; pick another or delete that one",
            )
            assert listing(sandboxd) == before
    finally:
        if resp.status == 201:
            sandboxd.request("DELETE", f"/v1/sandboxes/{resp.json()['id']}")


def test_ambiguous_name_ref_is_409_naming_the_ids(sandboxd: Sandboxd, shared: list[dict[str, Any]]) -> None:
    ids = ", ".join(sorted(s["id"] for s in shared))
    message = f"the name 'web' matches 3 live sandboxes ({ids}); use the id"
    before = listing(sandboxd)
    for method, path, body in [
        ("GET", "", None),
        ("DELETE", "", None),
        ("PATCH", "", {"name": "mine"}),
        ("POST", "/run", {"argv": ["true"]}),
        ("GET", "/events", None),
        ("GET", "/files?path=/etc/hostname", None),
    ]:
        resp = sandboxd.request(method, f"/v1/sandboxes/web{path}", body)
        assert (resp.status, resp.error) == (409, ("conflict", message)), (method, path)
    assert listing(sandboxd) == before  # nothing terminated, nothing renamed
    # Ids still reach each one; once only one holds the name, the name reaches it again.
    assert sandboxd.request("GET", f"/v1/sandboxes/{shared[0]['id']}").json()["name"] == "web"
    for s in shared[1:]:
        assert sandboxd.request("DELETE", f"/v1/sandboxes/{s['id']}").status == 204
    assert sandboxd.request("GET", "/v1/sandboxes/web").json()["id"] == shared[0]["id"]


def test_patch_checks_the_name_in_its_new_scope(sandboxd: Sandboxd, shared: list[dict[str, Any]]) -> None:
    alice_web = shared[0]
    other = sandboxd.create(name="api", labels={OWNER: "alice"})
    try:
        ref = f"/v1/sandboxes/{other['id']}"
        # Renaming into a name the same owner holds is 409; into one only other owners hold is fine.
        taken = sandboxd.request("PATCH", ref, {"name": "web"})
        assert (taken.status, taken.error) == (
            409,
            ("conflict", "the name 'web' is in use by a live sandbox"),
        )
        assert sandboxd.request("GET", ref).json()["name"] == "api"
        # Moving labels into a scope where the name is taken is 409 too (the name itself unchanged).
        moved = sandboxd.request("PATCH", f"/v1/sandboxes/{alice_web['id']}", {"labels": {OWNER: "bob"}})
        assert (moved.status, moved.error) == (
            409,
            ("conflict", "the name 'web' is in use by a live sandbox"),
        )
        assert sandboxd.request("GET", f"/v1/sandboxes/{alice_web['id']}").json()["labels"] == {
            OWNER: "alice"
        }
        free = sandboxd.request("PATCH", ref, {"name": "web", "labels": {OWNER: "dora"}})
        assert free.status == 200 and free.json()["name"] == "web"
        # Unchanged name and scope: no check at all.
        again = sandboxd.request("PATCH", ref, {"name": "web", "labels": {OWNER: "dora", "x": "1"}})
        assert again.status == 200
    finally:
        sandboxd.request("DELETE", f"/v1/sandboxes/{other['id']}")
