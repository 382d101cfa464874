"""The images API (capability ``images``) and creates from pulled images, against a real sandboxd and Debian's
``docker-registry`` on loopback serving images these tests build: a tiny root of host binaries (dash,
coreutils and their libraries) plus a config with Env and WorkingDir.

Pulled images go to the shared image store under repositories unique to this run, and are removed again.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from oci_registry import Entry, Image, Proxy, Registry, build_image, layer, push, temporary_registry
from sandboxd_harness import IMAGES_DIR, Response, Sandboxd, free_port

from sbx.net.ranges import read_host_addresses

pytestmark = pytest.mark.timeout(300)

#: Programs put into the test images, by their name inside.
PROGRAMS = {
    "sh": "/usr/bin/dash",
    "env": "/usr/bin/env",
    "pwd": "/usr/bin/pwd",
    "cat": "/usr/bin/cat",
    "ls": "/usr/bin/ls",
    "touch": "/usr/bin/touch",
    "sleep": "/usr/bin/sleep",
    "id": "/usr/bin/id",
}
RUN_ID = uuid.uuid4().hex[:8]
#: Repositories of this module; the server's [images] allowed permits exactly these.
REPO_PREFIX = f"sbxtest{RUN_ID}"


def _libraries() -> set[str]:
    libs: set[str] = set()
    for path in PROGRAMS.values():
        out = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            parts = line.split()
            lib = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
            if lib.startswith("/"):
                libs.add(lib)
    return libs


def mini_root_layer() -> bytes:
    """An uncompressed layer holding the programs of PROGRAMS and the libraries they need (merged /usr)."""
    entries = [Entry(d, kind="dir") for d in ("usr", "usr/bin", "usr/lib", "usr/lib/x86_64-linux-gnu",
                                              "usr/lib64", "etc", "srv", "srv/app")]  # fmt: skip
    entries += [Entry(n, kind="symlink", link=f"usr/{n}") for n in ("bin", "lib", "lib64")]
    for name, path in PROGRAMS.items():
        entries.append(Entry(f"usr/bin/{name}", data=Path(path).read_bytes(), mode=0o755))
    for lib in sorted(_libraries()):
        inside = "usr/lib64" if "/lib64/" in lib else "usr/lib/x86_64-linux-gnu"
        entries.append(
            Entry(f"{inside}/{os.path.basename(lib)}", data=Path(lib).resolve().read_bytes(), mode=0o755)
        )
    return layer(entries, compress=False)


def mini_image(
    env: list[str] | None = None, working_dir: str | None = None, extra: bytes | None = None
) -> Image:
    config: dict[str, Any] = {"Env": env or ["PATH=/usr/bin:/bin"], "Entrypoint": ["/bin/sh"], "Cmd": ["-c", "true"],
                              "User": "nobody"}  # fmt: skip
    if working_dir:
        config["WorkingDir"] = working_dir
    layers = [mini_root_layer()] + ([extra] if extra is not None else [])
    return build_image(layers, config)


def filler_layer(size: int) -> bytes:
    """A gzip layer of ``size`` random (incompressible) bytes in one file."""
    return layer([Entry("filler.bin", data=os.urandom(size))])


def wait_for(server: Sandboxd, image: str, state: str, timeout_secs: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_secs
    while time.monotonic() < deadline:
        found = [i for i in server.request("GET", "/v1/images").json()["images"] if i["image"] == image]
        if found and found[0]["state"] == state:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"{image} never reached {state}: {found}")


def listed(server: Sandboxd) -> list[dict[str, Any]]:
    return server.request("GET", "/v1/images").json()["images"]  # type: ignore[no-any-return]


def run(server: Sandboxd, ref: str, argv: list[str], **fields: Any) -> tuple[int, str]:
    result = server.run(ref, argv, **fields)
    return result["exit_code"], result["stdout"].decode()


# --- fixtures ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    with temporary_registry() as reg:
        yield reg


def images_config(private_registries: list[str], extra: str = "") -> str:
    """The node's [images]: the test's repositories allowed, and its loopback registries listed as private
    registries (as an operator lists an internal one)."""
    return (
        f'[images]\nallowed = ["127.0.0.1:*/{REPO_PREFIX}*/**"]\n'
        f"allow_private_registries = {json.dumps(private_registries)}\n{extra}"
    )


@pytest.fixture(scope="module")
def proxy_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(registry: Registry, proxy_port: int) -> Iterator[Sandboxd]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxd-", dir="/var/tmp"))
    # The registry, the proxy in front of it, and port 1 where nothing listens (a registry that is down).
    private = [registry.host, f"127.0.0.1:{proxy_port}", "127.0.0.1:1"]
    srv = Sandboxd(workdir, images_config(private)).start()
    yield srv
    for image in listed(srv):
        if REPO_PREFIX in image["image"]:
            for sandbox in srv.request("GET", "/v1/sandboxes").json()["sandboxes"]:
                if sandbox["image"] == image["image"]:
                    srv.request("DELETE", f"/v1/sandboxes/{sandbox['id']}")
            srv.request("DELETE", f"/v1/images?image={image['image']}")
    srv.teardown()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
async def proxy(registry: Registry, proxy_port: int) -> AsyncIterator[Proxy]:
    p = await Proxy(registry.url, port=proxy_port).start()
    yield p
    await p.stop()


def push_sync(registry: Registry, repo: str, tag: str, image: Image) -> str:
    """Push and return the reference sandboxd installs it under."""
    asyncio.run(push(registry.url, repo, tag, image))
    return f"{registry.host}/{repo}:{tag}"


async def call(server: Sandboxd, method: str, path: str, body: Any = None) -> Response:
    return await asyncio.to_thread(server.request, method, path, body)


async def settled(
    server: Sandboxd, ref: str, progress: list[dict[str, Any]] | None = None, timeout_secs: float = 60
) -> dict[str, Any]:
    """The listing entry of ``ref`` once it is no longer installing (or after ``timeout_secs``), appending
    each progress seen meanwhile to ``progress``."""
    deadline = time.monotonic() + timeout_secs
    while True:
        entry = next(
            i for i in (await call(server, "GET", "/v1/images")).json()["images"] if i["image"] == ref
        )
        if entry["state"] != "installing" or time.monotonic() > deadline:
            return entry  # type: ignore[no-any-return]
        if progress is not None:
            progress.append(entry["progress"])
        await asyncio.sleep(0.05)


# --- install, progress, joining --------------------------------------------------------------------------------


async def test_install_shows_progress_and_joins_a_second_post(
    server: Sandboxd, registry: Registry, proxy: Proxy
) -> None:
    image = mini_image(extra=filler_layer(4 << 20))
    await push(registry.url, f"{REPO_PREFIX}/progress", "1", image)
    proxy.delay_secs = 1.0  # each blob GET waits: the install is seen while it runs
    ref = f"{proxy.host}/{REPO_PREFIX}/progress:1"

    first = await call(server, "POST", "/v1/images", {"image": ref})
    assert first.status == 202, first.body
    body = first.json()
    assert body["image"] == ref and body["state"] == "installing"
    assert set(body["progress"]) == {"phase", "done", "total"}
    second = await call(server, "POST", "/v1/images", {"image": ref})
    assert second.status == 202 and second.json()["state"] == "installing"

    seen: list[dict[str, Any]] = []
    entry = await settled(server, ref, seen)
    assert entry["state"] == "installed", entry
    assert entry["digest"] == image.digest
    assert entry["bytes"] > 4 << 20 and entry["in_use"] == 0
    assert entry["default"] is False and entry["pooled"] is False
    assert "progress" not in entry and "error" not in entry
    total = sum(len(b) for d, b in image.blobs.items() if d in image.layer_digests)
    assert any(p["phase"] == "pulling" and p["total"] == total for p in seen), seen
    # Joined: the new layer was fetched once although two POSTs asked (the base layer may be cached already).
    assert proxy.blob_gets[image.layer_digests[1]] == 1, proxy.blob_gets
    assert proxy.blob_gets[image.layer_digests[0]] <= 1, proxy.blob_gets


def test_post_of_an_installed_image_rechecks_its_tag(server: Sandboxd, registry: Registry) -> None:
    ref = push_sync(registry, f"{REPO_PREFIX}/recheck", "1", mini_image(env=["PATH=/usr/bin:/bin", "V=1"]))
    assert server.request("POST", "/v1/images", {"image": ref}).status == 202
    first = wait_for(server, ref, "installed")
    # Unchanged tag: still the same image.
    assert server.request("POST", "/v1/images", {"image": ref}).status == 202
    assert wait_for(server, ref, "installed")["digest"] == first["digest"]
    # The tag moves: the re-check installs the new image.
    moved = mini_image(env=["PATH=/usr/bin:/bin", "V=2"])
    push_sync(registry, f"{REPO_PREFIX}/recheck", "1", moved)
    assert server.request("POST", "/v1/images", {"image": ref}).status == 202
    deadline = time.monotonic() + 60
    while wait_for(server, ref, "installed")["digest"] != moved.digest and time.monotonic() < deadline:
        time.sleep(0.05)
    assert wait_for(server, ref, "installed")["digest"] == moved.digest


def test_listing_is_sorted_and_marks_the_default(server: Sandboxd) -> None:
    images = listed(server)
    assert [i["image"] for i in images] == sorted(i["image"] for i in images)
    default = next(i for i in images if i["image"] == "default")
    assert default["default"] is True and default["state"] == "installed" and default["bytes"] > 0
    caps = server.request("GET", "/v1/capabilities").json()
    assert caps["capabilities"]["images"] is True


# --- refusals: each leaves the list as it was --------------------------------------------------------------------


REFUSED_POSTS = [
    ("invalid-reference", {"image": "Not_Valid:"}, 400, "invalid_request", "image reference"),
    ("uppercase-repository", {"image": "127.0.0.1:5000/Upper/x:1"}, 400, "invalid_request", "lowercase"),
    ("forbidden", {"image": "127.0.0.1:5000/elsewhere/x:1"}, 403, "refused", "not allowed on this node"),
    ("docker-hub-forbidden", {"image": "python:3.12"}, 403, "refused", "docker.io/library/python:3.12"),
    ("missing-image", {}, 400, "invalid_request", "image is required"),
    ("unknown-field", {"image": "x", "tag": "1"}, 400, "invalid_request", "unknown field 'tag'"),
    ("not-a-string", {"image": 3}, 400, "invalid_request", "image: expected a string, got an integer"),
]


@pytest.mark.parametrize(("body", "status", "code", "needle"), [c[1:] for c in REFUSED_POSTS],
                         ids=[c[0] for c in REFUSED_POSTS])  # fmt: skip
def test_refused_install_changes_nothing(
    server: Sandboxd, body: dict[str, Any], status: int, code: str, needle: str
) -> None:
    before = listed(server)
    resp = server.request("POST", "/v1/images", body)
    assert resp.status == status, resp.body
    assert resp.error[0] == code
    assert needle in resp.error[1], resp.error
    assert listed(server) == before


def test_failed_install_is_listed_with_its_error_until_removed(server: Sandboxd, registry: Registry) -> None:
    ref = f"{registry.host}/{REPO_PREFIX}/absent:1"
    assert server.request("POST", "/v1/images", {"image": ref}).status == 202
    failed = wait_for(server, ref, "failed")
    assert failed.get("error"), failed
    assert "digest" not in failed and failed["bytes"] == 0
    # Removing a failed image forgets it.
    resp = server.request("DELETE", f"/v1/images?image={ref}")
    assert resp.status == 200 and resp.json() == {"image": ref, "freed_bytes": 0}
    assert ref not in [i["image"] for i in listed(server)]


# --- DELETE ------------------------------------------------------------------------------------------------------


def test_delete_frees_the_root_and_unshared_layers(server: Sandboxd, registry: Registry) -> None:
    base = mini_root_layer()
    one = build_image([base, filler_layer(1 << 20)], {"Env": ["PATH=/usr/bin"]})
    two = build_image([base, filler_layer(1 << 20)], {"Env": ["PATH=/usr/bin"]})
    ref1 = push_sync(registry, f"{REPO_PREFIX}/del", "one", one)
    ref2 = push_sync(registry, f"{REPO_PREFIX}/del", "two", two)
    for ref in (ref1, ref2):
        server.request("POST", "/v1/images", {"image": ref})
    installed = {ref: wait_for(server, ref, "installed") for ref in (ref1, ref2)}
    blob_dir = IMAGES_DIR / "blobs" / "sha256"
    shared, own = one.layer_digests[0].split(":")[1], one.layer_digests[1].split(":")[1]
    assert (blob_dir / shared).exists() and (blob_dir / own).exists()

    resp = server.request("DELETE", f"/v1/images?image={ref1}")
    assert resp.status == 200, resp.body
    body = resp.json()
    assert body["image"] == ref1
    # The root, plus the layer only it recorded; the shared base layer stays for ref2.
    assert body["freed_bytes"] >= installed[ref1]["bytes"] + (1 << 20)
    assert not (blob_dir / own).exists() and (blob_dir / shared).exists()
    assert ref1 not in [i["image"] for i in listed(server)]
    # Gone now: 404, and nothing else changed.
    before = listed(server)
    again = server.request("DELETE", f"/v1/images?image={ref1}")
    assert again.status == 404 and again.error[0] == "not_found" and "not installed" in again.error[1]
    assert listed(server) == before
    assert server.request("DELETE", f"/v1/images?image={ref2}").status == 200


def test_delete_refusals_change_nothing(server: Sandboxd, registry: Registry) -> None:
    ref = push_sync(registry, f"{REPO_PREFIX}/inuse", "1", mini_image())
    sandbox = server.create(image=ref)
    cases = [
        ("default", 409, "conflict", "default image"),
        (ref, 409, "conflict", "in use by 1 sandbox"),
        ("Bad_Ref:", 400, "invalid_request", "image reference"),
        (f"{registry.host}/{REPO_PREFIX}/never:1", 404, "not_found", "not installed"),
    ]
    for image, status, code, needle in cases:
        before = listed(server)
        resp = server.request("DELETE", f"/v1/images?image={image}")
        assert (resp.status, resp.error[0]) == (status, code), (image, resp.body)
        assert needle in resp.error[1], resp.error
        assert listed(server) == before
    entry = next(i for i in listed(server) if i["image"] == ref)
    assert entry["in_use"] == 1
    server.request("DELETE", f"/v1/sandboxes/{sandbox['id']}")
    assert next(i for i in listed(server) if i["image"] == ref)["in_use"] == 0
    assert server.request("DELETE", f"/v1/images?image={ref}").status == 200
    missing = server.request("DELETE", "/v1/images")
    assert missing.status == 400 and "image" in missing.error[1]


async def test_delete_while_installing_is_409(server: Sandboxd, registry: Registry, proxy: Proxy) -> None:
    await push(registry.url, f"{REPO_PREFIX}/slow", "1", mini_image())
    proxy.delay_secs = 2.0
    ref = f"{proxy.host}/{REPO_PREFIX}/slow:1"
    assert (await call(server, "POST", "/v1/images", {"image": ref})).status == 202
    resp = await call(server, "DELETE", f"/v1/images?image={ref}")
    assert resp.status == 409 and "being installed" in resp.error[1]
    assert (await settled(server, ref))["state"] == "installed"


# --- creates from images ------------------------------------------------------------------------------------------


def test_create_pulls_an_image_not_installed_and_applies_its_config(
    server: Sandboxd, registry: Registry
) -> None:
    image = mini_image(
        env=["PATH=/usr/bin:/bin", "FROM_IMAGE=image", "OVERRIDDEN=image"], working_dir="/srv/app"
    )
    short = f"{registry.host}/{REPO_PREFIX}/app"  # no tag: latest
    push_sync(registry, f"{REPO_PREFIX}/app", "latest", image)
    ref = f"{short}:latest"
    assert ref not in [i["image"] for i in listed(server)]

    created = server.create(image=short, env={"OVERRIDDEN": "sandbox"})
    assert created["image"] == ref  # recorded under its normalised name
    assert wait_for(server, ref, "installed")["in_use"] == 1
    sid = created["id"]
    code, out = run(server, sid, ["env"])
    env = dict(line.split("=", 1) for line in out.splitlines())
    assert code == 0
    assert env["FROM_IMAGE"] == "image"  # image Env applies...
    assert env["OVERRIDDEN"] == "sandbox"  # ...below the sandbox's env...
    assert run(server, sid, ["env"], env={"OVERRIDDEN": "request"})[1].count("OVERRIDDEN=request") == 1
    assert env["PATH"] == "/usr/bin:/bin"  # ...and over the node's base env
    assert env["HOME"] == "/sandbox/home"
    # WorkingDir is the default cwd; a request's cwd wins.
    assert run(server, sid, ["pwd"]) == (0, "/srv/app\n")
    assert run(server, sid, ["pwd"], cwd="/tmp") == (0, "/tmp\n")
    # User is not applied: processes always run as the sandbox user.
    assert run(server, sid, ["id", "-u"]) == (0, "1000\n")
    # A background process gets the same environment and cwd.
    resp = server.request("POST", f"/v1/sandboxes/{sid}/processes", {"argv": ["pwd"]})
    assert resp.status == 201
    out_events = list(server.follow(sid, resp.json()["pid"]))
    assert base64.b64decode(out_events[0]["data"]) == b"/srv/app\n"
    server.request("DELETE", f"/v1/sandboxes/{sid}")


def test_working_dir_missing_from_the_image_falls_back_to_home(server: Sandboxd, registry: Registry) -> None:
    ref = push_sync(registry, f"{REPO_PREFIX}/nowd", "1", mini_image(working_dir="/does/not/exist"))
    sid = server.create(image=ref)["id"]
    assert run(server, sid, ["pwd"]) == (0, "/sandbox/home\n")
    server.request("DELETE", f"/v1/sandboxes/{sid}")


def _sandbox_ids(server: Sandboxd) -> list[str]:
    return [s["id"] for s in server.request("GET", "/v1/sandboxes").json()["sandboxes"]]


@pytest.mark.parametrize(
    ("image", "status", "code", "needle"),
    [
        pytest.param("{host}/{prefix}/nosuch:1", 400, "invalid_request", "could not be installed", id="not-in-registry"),
        pytest.param("127.0.0.1:1/{prefix}/down:1", 503, "unavailable", "try again later", id="registry-down"),
        pytest.param("127.0.0.1:5000/forbidden/x:1", 403, "refused", "not allowed", id="forbidden"),
        pytest.param("Bad_Ref:", 400, "invalid_request", "image reference", id="invalid-reference"),
    ],
)  # fmt: skip
def test_create_from_an_image_that_cannot_be_pulled_changes_nothing(
    server: Sandboxd, registry: Registry, image: str, status: int, code: str, needle: str
) -> None:
    image = image.format(host=registry.host, prefix=REPO_PREFIX)
    before, free_before = _sandbox_ids(server), server.request("GET", "/v1/node").json()["free"]
    resp = server.request("POST", "/v1/sandboxes", {"image": image})
    assert (resp.status, resp.error[0]) == (status, code), resp.body
    assert needle in resp.error[1], resp.error
    assert _sandbox_ids(server) == before
    assert server.request("GET", "/v1/node").json()["free"] == free_before
    assert all(
        i["state"] != "installed" or i["image"] == "default" or REPO_PREFIX in i["image"]
        for i in listed(server)
    )


# --- request forgery through the image reference (issue 11, item 3) -------------------------------------------


class LoopbackService:
    """A service on loopback that no sandbox user should reach: answers every connection with ``answer``
    (not HTTP by default) and counts them. With ``redirect_to``, answers HTTP 302 to that URL instead."""

    def __init__(self, answer: bytes = b"HOST-SECRET\r\n", redirect_to: str | None = None) -> None:
        if redirect_to is not None:
            answer = f"HTTP/1.1 302 Found\r\nLocation: {redirect_to}\r\nContent-Length: 0\r\n\r\n".encode()
        self.answer = answer
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(4096)
                    conn.sendall(self.answer)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def secret_service() -> Iterator[LoopbackService]:
    service = LoopbackService()
    yield service
    service.close()


@pytest.mark.parametrize(
    ("image", "needle"),
    [
        pytest.param("127.0.0.1:{port}/probe:1", "list 127.0.0.1:{port} in [images] allow_private_registries", id="loopback"),
        pytest.param("localhost:{port}/probe:1", "is at 127.0.0.1", id="name-resolving-to-loopback"),
        pytest.param("[::ffff:127.0.0.1]:{port}/probe:1", "loopback, private", id="mapped-loopback"),
        pytest.param("{own}:{port}/probe:1", "loopback, private or this host's own address", id="own-address"),
        pytest.param("169.254.169.254/latest/meta-data:1", "link-local, metadata", id="metadata"),
        pytest.param("169.254.169.254:80/latest/meta-data:1", "link-local, metadata", id="metadata-http"),
        pytest.param("10.20.30.40:5000/internal:1", "loopback, private", id="private"),
        pytest.param("0.0.0.0:{port}/probe:1", "link-local, metadata or reserved", id="unspecified"),
    ],
)  # fmt: skip
def test_an_image_reference_never_reaches_a_host_service(
    sandboxd_factory: Any, secret_service: LoopbackService, image: str, needle: str
) -> None:
    own = [a for a in read_host_addresses() if a.version == 4 and not a.is_loopback]
    # [images] as shipped: every reference allowed, no private registry listed.
    node = sandboxd_factory()
    image = image.format(port=secret_service.port, own=own[0] if own else "127.0.0.1")
    for path, body in (("/v1/sandboxes", {"image": image}), ("/v1/images", {"image": image})):
        resp = node.request("POST", path, body)
        if resp.status == 202:  # the install runs in the background: its failure is listed
            failed = wait_for(node, image, "failed")
            assert needle.format(port=secret_service.port) in failed["error"], failed
            assert "HOST-SECRET" not in json.dumps(failed)
            continue
        assert (resp.status, resp.error[0]) == (403, "refused"), resp.body
        assert needle.format(port=secret_service.port) in resp.error[1], resp.error
        assert b"HOST-SECRET" not in resp.body
    assert secret_service.connections == 0
    assert node.request("GET", "/v1/sandboxes").json()["sandboxes"] == []


def test_a_listed_registry_cannot_redirect_to_a_host_service(
    sandboxd_factory: Any, secret_service: LoopbackService
) -> None:
    redirector = LoopbackService(redirect_to=f"http://127.0.0.1:{secret_service.port}/v2/probe/manifests/1")
    try:
        node = sandboxd_factory(f'[images]\nallow_private_registries = ["127.0.0.1:{redirector.port}"]\n')
        resp = node.request("POST", "/v1/sandboxes", {"image": f"127.0.0.1:{redirector.port}/probe:1"})
        assert (resp.status, resp.error[0]) == (403, "refused"), resp.body
        assert f"127.0.0.1:{secret_service.port}" in resp.error[1] and b"HOST-SECRET" not in resp.body
        assert redirector.connections >= 1 and secret_service.connections == 0
    finally:
        redirector.close()


def test_a_listed_service_that_is_no_registry_is_not_echoed(
    sandboxd_factory: Any, secret_service: LoopbackService
) -> None:
    node = sandboxd_factory(f'[images]\nallow_private_registries = ["127.0.0.1:{secret_service.port}"]\n')
    resp = node.request("POST", "/v1/sandboxes", {"image": f"127.0.0.1:{secret_service.port}/probe:1"})
    assert resp.status in (400, 503) and b"HOST-SECRET" not in resp.body, resp.body
    assert secret_service.connections >= 1  # listed: reached, and still nothing of its answer comes back


# --- sandbox-cli images ----------------------------------------------------------------------------------------


def test_cli_images_pull_ls_rm(server: Sandboxd, registry: Registry) -> None:
    """`sandbox-cli images pull|ls|rm` against the real images API, progress bar included."""
    import json
    import sys

    ref = push_sync(registry, f"{REPO_PREFIX}-cli/app", "v1", mini_image(extra=filler_layer(4 << 20)))
    cli = [sys.executable, "-m", "sbx.cli.main", "--url", f"unix://{server.socket_path}"]
    pulled = subprocess.run(
        [*cli, "images", "pull", ref], capture_output=True, text=True, timeout=120, check=False
    )
    assert pulled.returncode == 0, pulled.stderr
    assert "pulling" in pulled.stderr  # the progress bar is drawn on stderr
    listing = subprocess.run([*cli, "--json", "images", "ls"], capture_output=True, text=True, check=False)
    assert listing.returncode == 0, listing.stderr
    entry = next(i for i in json.loads(listing.stdout)["images"] if i["image"] == ref)
    assert entry["state"] == "installed" and entry["digest"].startswith("sha256:")
    removed = subprocess.run([*cli, "images", "rm", ref], capture_output=True, text=True, check=False)
    assert removed.returncode == 0, removed.stderr
    again = subprocess.run([*cli, "images", "rm", ref], capture_output=True, text=True, check=False)
    assert again.returncode == 1 and again.stderr.startswith("not_found: ")
