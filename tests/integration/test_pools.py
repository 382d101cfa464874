"""Warm pools against a real sandboxd: filling, a create taking a pooled sandbox (audit reason pool), refill,
NodeStatus and metrics, no trace of one user in another's pooled sandbox, and the image rules."""

from __future__ import annotations

import shutil
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from oci_registry import Registry, temporary_registry
from sandboxd_harness import IMAGES_DIR, Sandboxd, free_port
from test_images_api import mini_image, push_sync

from sbx.images.blobs import collect_unused_blobs
from sbx.images.pull import blob_store
from sbx.images.store import ImageStore

pytestmark = pytest.mark.timeout(300)

POOL_SIZE = 2
PREFIX = f"sbxpool{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    with temporary_registry() as reg:
        yield reg


@pytest.fixture(scope="module")
def pooled_image(registry: Registry) -> str:
    return push_sync(registry, f"{PREFIX}/mini", "1", mini_image(env=["PATH=/usr/bin:/bin", "IMG=pool"]))


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(registry: Registry, pooled_image: str, metrics_port: int) -> Iterator[Sandboxd]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxd-", dir="/var/tmp"))
    config = (  # the test registry is on loopback: listed, as an operator lists an internal one
        f'[images]\nallowed = ["127.0.0.1:*/{PREFIX}/**"]\nallow_private_registries = ["{registry.host}"]\n\n'
        f'[[pools]]\nimage = "{pooled_image}"\nsize = {POOL_SIZE}\n'
    )
    srv = Sandboxd(workdir, config, args=["--metrics-listen", f"127.0.0.1:{metrics_port}"]).start()
    yield srv
    for sandbox in srv.request("GET", "/v1/sandboxes").json()["sandboxes"]:
        srv.request("DELETE", f"/v1/sandboxes/{sandbox['id']}")
    srv.teardown()
    # Not while the server runs: a pooled image cannot be removed. Remove it from the shared store directly.
    store = ImageStore(IMAGES_DIR)
    store.remove(pooled_image)
    collect_unused_blobs(store, blob_store(IMAGES_DIR))
    shutil.rmtree(workdir, ignore_errors=True)


def node(server: Sandboxd) -> dict[str, Any]:
    return server.request("GET", "/v1/node").json()  # type: ignore[no-any-return]


def wait_full(server: Sandboxd, image: str, timeout_secs: float = 90) -> None:
    deadline = time.monotonic() + timeout_secs
    while time.monotonic() < deadline:
        if node(server)["pooled"].get(image) == POOL_SIZE:
            return
        time.sleep(0.05)
    raise AssertionError(f"the pool never filled: {node(server)['pooled']}")


def live_ids(server: Sandboxd) -> list[str]:
    return [
        s["id"]
        for s in server.request("GET", "/v1/sandboxes").json()["sandboxes"]
        if s["state"] != "terminated"
    ]


def list_dir(path: str) -> list[str]:
    """A command printing every entry of ``path``, hidden ones included (the test image's shell globs)."""
    return ["sh", "-c", f'for f in {path}/* {path}/.[!.]*; do [ -e "$f" ] && echo "$f"; done; true']


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_pool_fills_and_is_reported(server: Sandboxd, pooled_image: str, metrics_port: int) -> None:
    wait_full(server, pooled_image)
    status = node(server)
    assert status["pooled"] == {pooled_image: POOL_SIZE}
    assert pooled_image in status["images"]
    # Pooled sandboxes hold resources but are nobody's: not listed, not running in the count.
    held = status["capacity"]["memory_mb"] - status["free"]["memory_mb"]
    assert held == POOL_SIZE * 512
    assert status["capacity"]["cpus"] - status["free"]["cpus"] == POOL_SIZE * 2  # the default cpus
    assert status["running"] == 0
    assert live_ids(server) == []
    m = metrics(metrics_port)
    label = f'{{image="{pooled_image}"}}'
    assert m[f"sandboxd_pool_target{label}"] == POOL_SIZE
    assert m[f"sandboxd_pool_ready{label}"] == POOL_SIZE
    assert m[f"sandboxd_pool_booting{label}"] == 0
    image = next(
        i for i in server.request("GET", "/v1/images").json()["images"] if i["image"] == pooled_image
    )
    assert image["pooled"] is True and image["in_use"] == 0


def test_create_takes_a_pooled_sandbox_fast_and_the_pool_refills(server: Sandboxd, pooled_image: str) -> None:
    wait_full(server, pooled_image)
    started = time.monotonic()
    created = server.create(image=pooled_image, name="from-pool", labels={"team": "a"}, env={"SECRET": "a"})
    took = time.monotonic() - started
    assert took < 0.5, took  # a fresh boot takes far longer; the bench measures it properly
    assert created["name"] == "from-pool" and created["labels"] == {"team": "a"}
    assert created["env_names"] == ["SECRET"] and created["state"] == "running"
    assert created["network"]["mode"] == "none"
    events = server.request("GET", f"/v1/sandboxes/{created['id']}/events").json()["events"]
    made = [e for e in events if e["type"] == "sandbox.created"]
    assert len(made) == 1 and made[0]["reason"] == "pool" and made[0]["name"] == "from-pool"
    assert made[0]["env_names"] == ["SECRET"] and made[0]["labels"] == {"team": "a"}
    result = server.run(created["id"], ["env"])
    env = dict(line.split("=", 1) for line in result["stdout"].decode().splitlines())
    assert env["SECRET"] == "a" and env["IMG"] == "pool"
    # Listed now, and in use.
    assert live_ids(server) == [created["id"]]
    image = next(
        i for i in server.request("GET", "/v1/images").json()["images"] if i["image"] == pooled_image
    )
    assert image["in_use"] == 1
    wait_full(server, pooled_image)  # refilled in the background
    assert node(server)["running"] == 1
    server.request("DELETE", f"/v1/sandboxes/{created['id']}")


def test_two_users_of_pooled_sandboxes_see_no_trace_of_each_other(
    server: Sandboxd, pooled_image: str
) -> None:
    wait_full(server, pooled_image)
    first = server.create(image=pooled_image, env={"WHO": "first"})
    assert (
        server.run(first["id"], ["touch", "/tmp/first-was-here", "/sandbox/home/first-home"])["exit_code"]
        == 0
    )
    bg = server.request("POST", f"/v1/sandboxes/{first['id']}/processes", {"argv": ["sleep", "60"]})
    assert bg.status == 201
    second = server.create(image=pooled_image, env={"WHO": "second"})
    assert second["id"] != first["id"]
    for sandbox, who in ((second, "second"), (first, "first")):
        events = server.request("GET", f"/v1/sandboxes/{sandbox['id']}/events").json()["events"]
        assert events[0]["type"] == "sandbox.created" and events[0]["reason"] == "pool"
        env = server.run(sandbox["id"], ["env"])["stdout"].decode()
        assert f"WHO={who}" in env and ("first" in env) == (who == "first")
    # Nothing of the first in the second: /tmp, home, processes.
    for path, mark in (("/tmp", "first-was-here"), ("/sandbox/home", "first-home")):
        mine = server.run(first["id"], list_dir(path))
        theirs = server.run(second["id"], list_dir(path))
        assert (mine["exit_code"], mine["stdout"].decode()) == (0, f"{path}/{mark}\n"), mine
        assert (theirs["exit_code"], theirs["stdout"]) == (0, b""), theirs
    procs = server.request("GET", f"/v1/sandboxes/{second['id']}/processes").json()["processes"]
    assert [p["argv"] for p in procs] == [["env"], list_dir("/tmp"), list_dir("/sandbox/home")]
    seen_second = server.run(second["id"], ["sh", "-c", "cat /proc/[0-9]*/cmdline"])["stdout"]
    seen_first = server.run(first["id"], ["sh", "-c", "cat /proc/[0-9]*/cmdline"])["stdout"]
    assert b"sleep" in seen_first and b"sleep" not in seen_second
    for sandbox in (first, second):
        server.request("DELETE", f"/v1/sandboxes/{sandbox['id']}")


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"cpus": 1}, id="other-cpus"),
        pytest.param({"memory_mb": 256}, id="other-memory"),
        pytest.param({}, id="other-image"),
    ],
)
def test_a_create_that_does_not_fit_boots_afresh(
    server: Sandboxd, pooled_image: str, fields: dict[str, Any]
) -> None:
    wait_full(server, pooled_image)
    image = "default" if not fields else pooled_image
    created = server.create(image=image, **fields)
    events = server.request("GET", f"/v1/sandboxes/{created['id']}/events").json()["events"]
    assert "reason" not in events[0]
    assert node(server)["pooled"][pooled_image] == POOL_SIZE  # the pool was not touched
    server.request("DELETE", f"/v1/sandboxes/{created['id']}")


def test_pooled_image_cannot_be_deleted(server: Sandboxd, pooled_image: str) -> None:
    before = server.request("GET", "/v1/images").json()
    resp = server.request("DELETE", f"/v1/images?image={pooled_image}")
    assert resp.status == 409 and resp.error[0] == "conflict" and "warm pool" in resp.error[1]
    assert server.request("GET", "/v1/images").json() == before


def test_cordon_stops_creates_but_keeps_the_pool(server: Sandboxd, pooled_image: str) -> None:
    wait_full(server, pooled_image)
    assert server.request("POST", "/v1/node/cordon", {"cordoned": True}).status == 200
    try:
        resp = server.request("POST", "/v1/sandboxes", {"image": pooled_image})
        assert resp.status == 503 and resp.error[0] == "unavailable" and "cordoned" in resp.error[1]
        assert node(server)["pooled"][pooled_image] == POOL_SIZE
        assert live_ids(server) == []  # nothing was handed out
    finally:
        server.request("POST", "/v1/node/cordon", {"cordoned": False})


def test_restart_destroys_pooled_sandboxes_and_refills(server: Sandboxd, pooled_image: str) -> None:
    wait_full(server, pooled_image)
    kept = server.create(image=pooled_image, name="survivor")
    wait_full(server, pooled_image)
    pool_dir = server.state_dir / "pool"
    old = {p.name for p in pool_dir.iterdir()}
    assert len(old) == POOL_SIZE
    server.stop()
    server.start()
    wait_full(server, pooled_image)
    new = {p.name for p in pool_dir.iterdir()}
    assert not old & new  # fresh ones: nothing from before a restart is handed out
    assert server.request("GET", f"/v1/sandboxes/{kept['id']}").json()["state"] == "running"
    assert server.run(kept["id"], ["id", "-u"])["stdout"] == b"1000\n"
    assert live_ids(server) == [kept["id"]]
    server.request("DELETE", f"/v1/sandboxes/{kept['id']}")
