"""Fuzzing both servers from their own API description (Schemathesis, bounded): whatever the input, no 500, and
every answer that is not 2xx has the error body with a status and code the description lists for that endpoint.

A real sandboxd (gVisor) on TCP with a token, and a gateway in front of it with an admin key. Inputs are drawn
from the schema, valid and invalid. Endpoints that would reach other machines (an image to pull, a node to add,
a job's notify URL) are held back by configuration (no image may be pulled, no egress, no notifications) or left
out (adding nodes); those that
would end the fuzzing's own sandbox or node are left out, and a second sandbox is there for the rest.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import requests
import schemathesis
from gateway_harness import GatewayProcess
from hypothesis import HealthCheck, settings
from sandboxd_harness import Sandboxd, free_port

from sbx.api.openapi import document

#: Cases per endpoint: about a minute for each server here (a gateway's create boots a sandbox on the node).
EXAMPLES = 12
GATEWAY_EXAMPLES = 8
#: Left out: they would end what the run stands on (its sandbox, its node) or reach other machines.
LEFT_OUT = {
    ("DELETE", "/v1/sandboxes/{ref}"),
    ("POST", "/v1/sandboxes/{ref}/suspend"),
    ("POST", "/v1/node/cordon"),
    ("POST", "/v1/admin/nodes"),
    ("DELETE", "/v1/admin/nodes/{name}"),
    ("POST", "/v1/admin/nodes/{name}/cordon"),
    ("POST", "/v1/admin/nodes/{name}/drain"),
    ("DELETE", "/v1/admin/keys/{id}"),
}
#: No image may be pulled (so no registry is ever asked), two sandboxes' room, no egress.
NODE_CONFIG = """
[images]
allowed = []
[capacity]
cpus = 8
memory_mb = 2048
disk_mb = 20000
"""

SCHEMA = schemathesis.openapi.from_dict(document())


def _described_errors(method: str, path: str) -> dict[int, set[str]]:
    responses = document()["paths"][path][method.lower()]["responses"]
    return {
        int(status): set(answer.get("x-codes", ()))
        for status, answer in responses.items()
        if int(status) >= 400
    }


def check_answer(method: str, path: str, status: int, content_type: str, text: str) -> None:
    """No 500; a non-2xx answer has the error body, with a status and code described for the endpoint (a
    method the path does not serve: 405, code invalid_request)."""
    assert status != 500, (method, path, text[:500])
    if status < 400:
        return
    assert content_type.startswith("application/json"), (method, path, status, text[:200])
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, (method, path, body)
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if method.lower() not in document()["paths"][path]:
        assert (status, body["error"]["code"]) == (405, "invalid_request"), (method, path, body)
        return
    described = _described_errors(method, path)
    assert status in described, (method, path, status, body)
    assert body["error"]["code"] in described[status], (method, path, status, body)


class Target:
    def __init__(self, base_url: str, token: str, ref: str) -> None:
        self.base_url = base_url
        self.token = token
        self.ref = ref
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"


def _node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    workdir = tmp_path_factory.mktemp("fuzz-node", numbered=True)
    token_file = workdir / "token"
    token_file.write_text("fuzz-token\n")
    port = free_port()
    server = Sandboxd(workdir, NODE_CONFIG, [
        "--socket", str(workdir / "s.sock"), "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file)
    ])  # fmt: skip
    server.socket_path = workdir / "s.sock"
    server.token = "fuzz-token"
    server.start()
    try:
        ref = server.create()["id"]
        server.create()  # a second, so a fuzzed rename or label change has something to clash with
        yield Target(f"http://127.0.0.1:{port}", "fuzz-token", ref)
    finally:
        server.teardown()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """The node fuzzed directly."""
    yield from _node(tmp_path_factory)


@pytest.fixture(scope="module")
def gateway_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """The node behind the fuzzed gateway: its own, so that what fuzzing the node made takes no room here."""
    yield from _node(tmp_path_factory)


def _fuzzed(schema: schemathesis.BaseSchema) -> schemathesis.BaseSchema:
    """``schema`` without the LEFT_OUT operations (never drawn, rather than drawn and skipped)."""
    for method, path in sorted(LEFT_OUT):
        schema = schema.exclude(method=method, path=path)
    return schema


def test_what_is_left_out_is_served() -> None:
    """A LEFT_OUT entry that names no operation would hide nothing and is stale."""
    served = {(method.upper(), path) for path, item in document()["paths"].items() for method in item}
    assert LEFT_OUT <= served


def _fuzz(target: Target, case: schemathesis.Case) -> None:
    # Half the cases aim at the real sandbox (deeper code), half at whatever was drawn (look-ups that fail).
    if (
        "ref" in (case.path_parameters or {})
        and hash(json.dumps(case.query or {}, sort_keys=True, default=str)) % 2
    ):
        case.path_parameters["ref"] = target.ref
    response = case.call(base_url=target.base_url, session=target.session, timeout=60)
    content_type = (response.headers.get("content-type") or [""])[0]
    check_answer(case.method, case.path, response.status_code, content_type, response.text)


node_schema = _fuzzed(SCHEMA.include(tag="node"))


@node_schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzz_the_node(node: Target, case: schemathesis.Case) -> None:
    _fuzz(node, case)


@pytest.fixture(scope="module")
def gateway(gateway_node: Target, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    node = gateway_node
    workdir = tmp_path_factory.mktemp("fuzz-gateway", numbered=True)
    token_file = workdir / "node-token"
    token_file.write_text(node.token)
    # Job notifications are refused outright (--no-notify): a fuzzed notify URL must never make the gateway
    # connect anywhere. A secrets key, so the secrets endpoints are driven past their 501. SSH served (on
    # loopback), so its endpoints take the fuzzed key lines and tokens, not only 404 unsupported.
    key_file = workdir / "secrets.key"
    key_file.write_text("ab" * 32)
    key_file.chmod(0o600)
    gw = GatewayProcess(
        workdir,
        [],
        ["--no-notify", "--secrets-key-file", str(key_file), "--ssh-listen", f"127.0.0.1:{free_port()}"],
    )
    gw.node_file.write_text(
        f'[[node]]\nname = "n1"\nendpoint = "{node.base_url}"\ntoken_file = "{token_file}"\n',
        encoding="utf-8",
    )
    admin = gw.create_key("root", "admin")
    gw.start()
    try:
        wait_until_placeable(gw, admin)
        made = gw.create(admin)
        yield Target(f"http://127.0.0.1:{gw.port}", admin, made["id"])
    finally:
        gw.stop()


def wait_until_placeable(gw: GatewayProcess, key: str, timeout_secs: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_secs
    while time.monotonic() < deadline:
        if gw.request("GET", "/v1/capabilities", key=key).status == 200:
            return
        time.sleep(0.1)
    raise AssertionError("the gateway's node never answered")


gateway_schema = _fuzzed(SCHEMA.include(tag="gateway"))


@gateway_schema.parametrize()
@settings(
    max_examples=GATEWAY_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)
def test_fuzz_the_gateway(gateway: Target, case: schemathesis.Case) -> None:
    _fuzz(gateway, case)
