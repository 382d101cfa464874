"""Secret environment on a real sandboxd (``secret_env``, capability ``secret_env``; docs/node-api.md, "Secret
environment"): its values reach the sandbox's processes and never the node's disk (records, process records,
audit log, the server's log, anything under its directory); the answers name it without a value; a restart of
sandboxd loses the values, which it says (``secret_env_lost``): processes running keep theirs, processes started
after do without; a pooled sandbox taken by a create gets them the same way; a bad ``secret_env`` changes
nothing."""

from __future__ import annotations

import base64
import hashlib
import secrets
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from sandboxd_harness import Sandboxd, files_holding

#: Prints the SHA-256 of $TOKEN (never the value: process output is kept on the node's disk), waits for a line,
#: then prints it again: the environment the process started with, read after whatever happened meanwhile.
TWICE = ["sh", "-c", 'printf %s "$TOKEN" | sha256sum; read x; printf %s "$TOKEN" | sha256sum']


def digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).hexdigest().encode() + b"  -\n"


def output(server: Sandboxd, ref: str, pid: int) -> bytes:
    return b"".join(base64.b64decode(x["data"]) for x in server.follow(ref, pid) if "data" in x)


def test_the_values_reach_processes_and_never_the_disk_and_a_restart_loses_them(
    sandboxd_factory: Callable[..., Sandboxd],
) -> None:
    server = sandboxd_factory()
    token, plain = "sbx-secret-" + secrets.token_hex(16), "sbx-plain-" + secrets.token_hex(16)
    assert server.request("GET", "/v1/capabilities").json()["capabilities"]["secret_env"] is True
    made = server.create(env={"PLAIN": plain}, secret_env={"TOKEN": token})
    ref = made["id"]
    assert (made["env_names"], made["secret_env_names"], made["secret_env_lost"]) == (
        ["PLAIN"],
        ["TOKEN"],
        False,
    )
    assert token not in str(made)
    twice = server.request("POST", f"/v1/sandboxes/{ref}/processes", {"argv": TWICE}).json()["pid"]
    seen = server.run(ref, ["sh", "-c", 'printf %s "$TOKEN" | sha256sum; printf %s "$PLAIN" | sha256sum'])
    assert seen["stdout"] == digest(token) + digest(plain)
    # A request's env is merged over it, as over env.
    assert server.run(ref, ["sh", "-c", 'echo "$TOKEN"'], env={"TOKEN": "mine"})["stdout"] == b"mine\n"
    events = server.request("GET", f"/v1/sandboxes/{ref}/events").json()["events"]
    created = next(e for e in events if e["type"] == "sandbox.created")
    assert (created["env_names"], created["secret_env_names"]) == (["PLAIN"], ["TOKEN"])
    # Nothing under the node's directory (state: records, processes, audit; its log; its config) holds the value,
    # where the plain env's value is in the sandbox's record as before (so the search does find what is there).
    assert files_holding(server.workdir, token) == []
    assert files_holding(server.workdir, plain) == [
        str(server.state_dir / "sandboxes" / ref / "sandbox.json")
    ]

    server.signal(signal.SIGKILL)
    server.start()
    again = server.request("GET", f"/v1/sandboxes/{ref}").json()
    assert (again["secret_env_names"], again["secret_env_lost"]) == (["TOKEN"], True)
    # The running process keeps the environment it started with; a process started now has none of it.
    assert server.request("POST", f"/v1/sandboxes/{ref}/processes/{twice}/stdin", body=b"go\n").status == 204
    assert output(server, ref, twice) == digest(token) * 2
    after = server.run(ref, ["sh", "-c", 'echo "${TOKEN-unset}"; printf %s "$PLAIN" | sha256sum'])
    assert after["stdout"] == b"unset\n" + digest(plain)
    assert files_holding(server.workdir, token) == []
    server.request("DELETE", f"/v1/sandboxes/{ref}")
    gone = server.request("GET", f"/v1/sandboxes/{ref}").json()
    assert (gone["state"], gone["secret_env_lost"]) == ("terminated", False)


def test_a_pooled_sandbox_gets_them_in_memory_too(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory('[[pools]]\nimage = "default"\nsize = 1\n')
    token = "sbx-secret-" + secrets.token_hex(16)
    deadline = time.monotonic() + 120
    while server.request("GET", "/v1/node").json()["pooled"].get("default") != 1:
        assert time.monotonic() < deadline, "the pool never filled"
        time.sleep(0.05)
    made = server.create(secret_env={"TOKEN": token})
    events = server.request("GET", f"/v1/sandboxes/{made['id']}/events").json()["events"]
    assert next(e for e in events if e["type"] == "sandbox.created")["reason"] == "pool"
    assert server.run(made["id"], ["sh", "-c", 'printf %s "$TOKEN" | sha256sum'])["stdout"] == digest(token)
    assert files_holding(server.workdir, token) == []


@pytest.mark.parametrize(
    ("body", "status", "code", "message"),
    [
        ({"secret_env": {"LD_PRELOAD": "/x.so"}}, 403, "refused",
         ("secret_env: LD_PRELOAD is reserved (it controls sandbox start-up, the loader or the shell); remove it "
          "from secret_env")),
        ({"env": {"TOKEN": "a"}, "secret_env": {"TOKEN": "b"}}, 400, "invalid_request",
         "secret_env: TOKEN also in env; give each variable in one of env and secret_env"),
        ({"secret_env": {"TOKEN": "a\u0000b"}}, 400, "invalid_request",
         "secret_env.TOKEN: the value contains a NUL character, which no environment can hold"),
        ({"secret_env": {"1X": "a"}}, 400, "invalid_request",
         ("secret_env: '1X' is not a valid environment variable name; use letters, digits and '_', not starting "
          "with a digit")),
    ],
    ids=["reserved", "also-in-env", "nul", "bad-name"],
)  # fmt: skip
def test_a_bad_secret_env_is_refused_and_makes_nothing(
    sandboxd: Sandboxd, body: dict[str, Any], status: int, code: str, message: str
) -> None:
    before = sandboxd.request("GET", "/v1/sandboxes").json()
    resp = sandboxd.request("POST", "/v1/sandboxes", body)
    assert (resp.status, resp.error) == (status, (code, message))
    assert sandboxd.request("GET", "/v1/sandboxes").json() == before
