"""An MCP session's sandboxes against a fake node (the SDK over a handler transport): persistent ones are
created with their name, shown as persistent, and left alone when the session ends, while every other sandbox
of the session is terminated. The real server and node: tests/integration/test_persistent_clients.py."""

from __future__ import annotations

from typing import Any

import pytest
from test_client import HandlerTransport
from wire_samples import capabilities_body, sandbox, sandbox_body

from sbx.api.codec import convert_request, to_builtins
from sbx.api.errors import InvalidRequest
from sbx.client import AsyncClient, Endpoint
from sbx.client._transport import Params
from sbx.mcp import tools as t
from sbx.mcp.session import Session, SessionConfig

#: The node's refusal of a persistent create without a name (sbx.api.requests.check_create).
NO_NAME = (
    "persistent: a persistent sandbox needs a name (it is found again by it after every sleep); add name"
)


class FakeNode:
    """Sandboxes by id, made and deleted as a node does; ``listing_fails`` makes the listing answer 503."""

    def __init__(self) -> None:
        self.boxes: dict[str, dict[str, Any]] = {}
        self.deleted: list[str] = []
        self.listing_fails = False

    def add(self, **fields: Any) -> dict[str, Any]:
        """A sandbox made behind the session's back (e.g. by a create whose answer was lost)."""
        box = sandbox_body(id=f"sbx_{len(self.boxes) + 1:016x}", **{"persistent": False, **fields})
        self.boxes[box["id"]] = box
        return box

    def handle(self, method: str, path: str, body: Any, params: Params | None) -> tuple[int, Any]:
        if (method, path) == ("GET", "/v1/capabilities"):
            return 200, capabilities_body(persistent=True)
        if (method, path) == ("POST", "/v1/sandboxes"):
            if body.get("persistent") and not body.get("name"):
                return 400, {"error": {"code": "invalid_request", "message": NO_NAME}}
            return 201, self.add(**body)
        if (method, path) == ("GET", "/v1/sandboxes"):
            if self.listing_fails:
                return 503, {"error": {"code": "unavailable", "message": "the node is restarting"}}
            wanted = [tuple(value.split("=", 1)) for key, value in params or [] if key == "label"]
            found = [b for b in self.boxes.values() if all(b["labels"].get(k) == v for k, v in wanted)]
            return 200, {"sandboxes": found}
        if method == "DELETE":
            sandbox_id = path.rsplit("/", 1)[-1]
            self.deleted.append(sandbox_id)
            self.boxes[sandbox_id]["state"] = "terminated"
            return 204, None
        raise AssertionError(f"unexpected {method} {path}")


def _session(node: FakeNode) -> Session:
    client = AsyncClient(transport=HandlerTransport(node.handle))
    return Session(SessionConfig(Endpoint("http://localhost", "/nonexistent.sock")), client)


async def _create(session: Session, **arguments: Any) -> t.SandboxSummary:
    return await session.create_sandbox(convert_request(arguments, t.CreateSandboxArgs))


async def test_a_persistent_sandbox_is_created_with_its_name_and_shown_as_persistent() -> None:
    node = FakeNode()
    session = _session(node)
    made = await _create(session, name="keep", persistent=True)
    plain = await _create(session)
    sent = {b["id"]: b for b in node.boxes.values()}
    assert sent[made.id]["persistent"] is True and sent[made.id]["name"] == "keep"
    assert (made.persistent, plain.persistent) == (True, False)
    shown = to_builtins(made)
    assert shown["persistent"] is True and "stopped_reason" not in shown
    stopped = session.summary(sandbox(persistent=True, state="stopped", stopped_reason="crash"))
    assert (stopped.state, stopped.persistent, stopped.stopped_reason) == ("stopped", True, "crash")
    await session.close()


async def test_the_nodes_refusal_of_a_nameless_persistent_sandbox_is_its_error() -> None:
    node = FakeNode()
    session = _session(node)
    with pytest.raises(InvalidRequest) as caught:
        await _create(session, persistent=True)
    assert caught.value.message == NO_NAME
    assert node.boxes == {} and session.sandboxes == set()
    await session.close()


#: What a session made, what else carries its label, whether the listing fails, and what its end terminates
#: (by name). "made:" sandboxes come through create_sandbox; "behind:" ones are on the node with the label only.
ENDINGS: list[tuple[list[str], bool, set[str]]] = [
    (["made:plain", "made:keep"], False, {"plain"}),
    (["made:keep"], False, set()),
    (["made:plain", "made:keep", "behind:stray", "behind:stray-keep"], False, {"plain", "stray"}),
    # Without the listing the session still knows what it made, persistent or not.
    (["made:plain", "made:keep", "behind:stray"], True, {"plain"}),
]


@pytest.mark.parametrize(("sandboxes", "listing_fails", "terminated"), ENDINGS,
                         ids=["mixed", "only-persistent", "with-strays", "listing-fails"])  # fmt: skip
async def test_the_end_of_a_session_leaves_its_persistent_sandboxes(
    sandboxes: list[str], listing_fails: bool, terminated: set[str]
) -> None:
    node = FakeNode()
    session = _session(node)
    for entry in sandboxes:
        how, name = entry.split(":")
        persistent = name.endswith("keep")
        if how == "made":
            await _create(session, name=name, persistent=persistent)
        else:
            node.add(name=name, persistent=persistent, labels={t.SESSION_LABEL: session.id})
    node.listing_fails = listing_fails
    await session.close()
    assert {node.boxes[i]["name"] for i in node.deleted} == terminated
    alive = {b["name"] for b in node.boxes.values() if b["state"] != "terminated"}
    assert alive == {entry.split(":")[1] for entry in sandboxes} - terminated


async def test_terminate_sandbox_removes_a_persistent_one() -> None:
    node = FakeNode()
    session = _session(node)
    made = await _create(session, name="keep", persistent=True)
    await session.terminate_sandbox(convert_request({"sandbox": made.id}, t.SandboxArgs))
    assert node.deleted == [made.id] and session.persistent == set()
    await session.close()
    assert node.deleted == [made.id]  # already terminated: the end has nothing left to do
