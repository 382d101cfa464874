"""Pulling images from a real registry (Debian's ``docker-registry``) on loopback, with images built and
pushed by the tests themselves: layers, manifest lists, token and basic auth, corruption, interruption,
joined pulls and shared layers. The registries, proxies and token servers are on loopback, so every pull lists
them in ``allow_private_registries`` (as an operator lists an internal registry)."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from oci_registry import (
    Entry,
    Proxy,
    Registry,
    TokenServer,
    build_image,
    build_index,
    layer,
    push,
)

from sbx.api.errors import InvalidRequest, NotFound, Refused, Unavailable
from sbx.images.blobs import BlobStore, collect_unused_blobs
from sbx.images.pull import blob_store, pull_image
from sbx.images.reference import parse_reference
from sbx.images.registry import RegistryClient, host_platform
from sbx.images.store import ImageStore

pytestmark = pytest.mark.timeout(120)


def _ensure_registry_binary() -> str | None:
    """None when docker-registry is there (installing it with apt-get when missing), else why not."""
    if shutil.which("docker-registry"):
        return None
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "docker-registry"],
                       env=os.environ | {"DEBIAN_FRONTEND": "noninteractive"}, capture_output=True, timeout=300, check=False)  # fmt: skip
    if shutil.which("docker-registry"):
        return None
    return "needs Debian's docker-registry package (apt-get install docker-registry), which is not installed"


@pytest.fixture(scope="module")
def registry_binary() -> None:
    reason = _ensure_registry_binary()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def start_registry(registry_binary: None, tmp_path: Path) -> Iterator[Callable[..., Registry]]:
    registries: list[Registry] = []

    def start(auth: dict[str, Any] | None = None) -> Registry:
        workdir = tmp_path / f"registry{len(registries)}"
        workdir.mkdir()
        reg = Registry(workdir, auth)
        registries.append(reg)
        return reg.start()

    yield start
    for reg in registries:
        reg.stop()


@pytest.fixture
async def proxy_factory() -> AsyncIterator[Callable[[Registry], Any]]:
    proxies: list[Proxy] = []

    async def start(reg: Registry) -> Proxy:
        proxies.append(await Proxy(reg.url).start())
        return proxies[-1]

    yield start
    for p in proxies:
        await p.stop()


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "images")


def blob_files(store: ImageStore) -> list[str]:
    root = store.images_dir / "blobs" / "sha256"
    return sorted(os.listdir(root)) if root.is_dir() else []


def hexes(*digests: str) -> list[str]:
    return sorted(d.split(":", 1)[1] for d in digests)


def other_arch() -> str:
    return "arm64" if host_platform().architecture != "arm64" else "amd64"


async def test_multi_layer_image(start_registry: Callable[..., Registry], store: ImageStore) -> None:
    reg = start_registry()
    base = layer([Entry("etc", kind="dir"), Entry("etc/os-release", b"ID=test\n"), Entry("bin/tool", b"#!x", mode=0o755),
                  Entry("old/a", b"1"), Entry("opq/lower", b"2"), Entry("lib", kind="symlink", link="usr/lib")])  # fmt: skip
    middle = layer([Entry("usr/lib/libx.so", b"elf"), Entry("big", os.urandom(2 << 20))], compress=False)
    top = layer(
        [Entry(".wh.old"), Entry("opq/.wh..wh..opq"), Entry("opq/upper", b"3"), Entry("lib/liby.so", b"y")]
    )
    config = {"Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8", "EMPTY="], "WorkingDir": "/srv", "User": "1000:1000",
              "Entrypoint": ["/bin/tool"], "Cmd": ["--serve", "8080"]}  # fmt: skip
    image = build_image([base, middle, top], config, architecture=host_platform().architecture)
    await push(reg.url, "team/app", "v1", image)
    events: list[tuple[str, int, int]] = []

    installed = await pull_image(
        store,
        f"{reg.host}/team/app:v1",
        allow_private_registries=[reg.host],
        progress=lambda *e: events.append(e),
    )

    assert installed.reference == f"{reg.host}/team/app:v1"
    assert installed.digest == image.digest
    assert installed.layers == tuple(image.layer_digests)
    assert installed.config.env == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "EMPTY": ""}
    assert (installed.config.working_dir, installed.config.user) == ("/srv", "1000:1000")
    assert installed.config.entrypoint == ("/bin/tool",) and installed.config.cmd == ("--serve", "8080")
    root = installed.rootfs
    assert (root / "etc/os-release").read_bytes() == b"ID=test\n"
    assert (root / "bin/tool").stat().st_mode & 0o777 == 0o755
    assert not (root / "old").exists(), "whiteout applied"
    assert sorted(os.listdir(root / "opq")) == ["upper"], "opaque directory applied"
    assert (root / "usr/lib/liby.so").read_bytes() == b"y", (
        "written through the usrmerge symlink, inside the root"
    )
    assert (root / ".sbx" / "agent").is_file(), "the store added the mount points"
    assert store.get(installed.reference) == installed
    assert blob_files(store) == hexes(*image.layer_digests)
    total = sum(len(b) for b in (base, middle, top))
    pulling = [e for e in events if e[0] == "pulling"]
    assert pulling[-1] == ("pulling", total, total)
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(pulling)), "progress never goes back"
    assert events[-1] == ("building", total, total)

    # Same digest: nothing fetched or rebuilt.
    again = await pull_image(store, f"{reg.host}/team/app:v1", allow_private_registries=[reg.host])
    assert again == installed


async def test_manifest_list_picks_this_hosts_platform(start_registry: Callable[..., Registry],
                                                         store: ImageStore) -> None:  # fmt: skip
    reg = start_registry()
    host = host_platform()
    foreign = build_image([layer([Entry("which", b"foreign")])], architecture=other_arch(), docker=True)
    native = build_image([layer([Entry("which", b"native")])], {"Cmd": ["sh"]}, architecture=host.architecture,
                         variant=host.variant, docker=True)  # fmt: skip
    attestation = build_image([layer([Entry("sbom.json", b"{}")])], architecture="unknown", docker=True)
    plat = {"os": "linux", "architecture": host.architecture} | (
        {"variant": host.variant} if host.variant else {}
    )
    index = build_index([(foreign, {"os": "linux", "architecture": other_arch()}),
                         (attestation, {"os": "unknown", "architecture": "unknown"}),
                         (native, plat)], docker=True)  # fmt: skip
    await push(reg.url, "multi", "latest", index, children=[foreign, attestation, native])

    installed = await pull_image(store, f"{reg.host}/multi", allow_private_registries=[reg.host])

    assert installed.reference == f"{reg.host}/multi:latest"
    assert (installed.rootfs / "which").read_bytes() == b"native"
    assert installed.digest == index.digest, "the digest is the one the tag points at"
    assert installed.annotations["sbx.manifest_digest"] == native.digest
    assert installed.config.cmd == ("sh",)
    assert blob_files(store) == hexes(*native.layer_digests)

    # An index without this platform is a clear error naming what it offers.
    only_foreign = build_index([(foreign, {"os": "linux", "architecture": other_arch()})])
    await push(reg.url, "foreign", "1", only_foreign, children=[foreign])
    with pytest.raises(InvalidRequest, match=f"no image for this host's platform linux/{host.architecture}.*"
                       f"offers: linux/{other_arch()}"):  # fmt: skip
        await pull_image(store, f"{reg.host}/foreign:1", allow_private_registries=[reg.host])
    assert store.get(f"{reg.host}/foreign:1") is None


async def test_token_auth(start_registry: Callable[..., Registry], store: ImageStore, tmp_path: Path) -> None:
    tokens = await TokenServer(tmp_path, users={"alice": "s3cret"}).start()
    try:
        reg = start_registry(tokens.registry_auth())
        push_token = tokens.token("public/app", ["pull", "push"], "setup")
        image = build_image([layer([Entry("hello", b"public")])])
        await push(reg.url, "public/app", "1", image, {"Authorization": f"Bearer {push_token}"})
        private = build_image([layer([Entry("hello", b"private")])])
        private_token = tokens.token("private/app", ["pull", "push"], "setup")
        await push(reg.url, "private/app", "1", private, {"Authorization": f"Bearer {private_token}"})

        installed = await pull_image(
            store, f"{reg.host}/public/app:1", allow_private_registries=[reg.host, f"127.0.0.1:{tokens.port}"]
        )
        assert (installed.rootfs / "hello").read_bytes() == b"public"
        assert ("repository:public/app:pull", None) in tokens.requests, "anonymous pull token"

        with pytest.raises(Refused, match="needs a login.*pass a credentials file"):
            await pull_image(
                store,
                f"{reg.host}/private/app:1",
                allow_private_registries=[reg.host, f"127.0.0.1:{tokens.port}"],
            )
        creds = tmp_path / "config.json"
        creds.write_text(
            json.dumps({"auths": {f"http://{reg.host}/v2/": {"username": "alice", "password": "bad"}}})
        )
        with pytest.raises(Refused, match=f"rejected the login.*check the login for {reg.host} in {creds}"):
            await pull_image(
                store,
                f"{reg.host}/private/app:1",
                allow_private_registries=[reg.host, f"127.0.0.1:{tokens.port}"],
                credentials_file=creds,
            )
        auth = base64.b64encode(b"alice:s3cret").decode()
        creds.write_text(json.dumps({"auths": {reg.host: {"auth": auth}}}))
        installed = await pull_image(
            store,
            f"{reg.host}/private/app:1",
            allow_private_registries=[reg.host, f"127.0.0.1:{tokens.port}"],
            credentials_file=creds,
        )
        assert (installed.rootfs / "hello").read_bytes() == b"private"
        assert ("repository:private/app:pull", "alice") in tokens.requests
        assert store.get(f"{reg.host}/private/app:1") is not None
    finally:
        await tokens.stop()


async def test_basic_auth(start_registry: Callable[..., Registry], store: ImageStore, tmp_path: Path) -> None:
    if not shutil.which("htpasswd"):
        pytest.skip("needs htpasswd from the apache2-utils package (apt-get install apache2-utils)")
    htpasswd = tmp_path / "htpasswd"
    await asyncio.to_thread(
        subprocess.run, ["htpasswd", "-Bbc", str(htpasswd), "bob", "hunter2"], check=True, capture_output=True
    )
    reg = start_registry({"htpasswd": {"realm": "sbx-test", "path": str(htpasswd)}})
    image = build_image([layer([Entry("f", b"basic")])])
    await push(
        reg.url, "app", "1", image, {"Authorization": "Basic " + base64.b64encode(b"bob:hunter2").decode()}
    )

    with pytest.raises(Refused, match=f"registry {reg.host} needs a login"):
        await pull_image(store, f"{reg.host}/app:1", allow_private_registries=[reg.host])
    creds = tmp_path / "config.json"
    creds.write_text(json.dumps({"auths": {reg.host: {"auth": base64.b64encode(b"bob:wrong").decode()}}}))
    with pytest.raises(Refused, match="rejected the login"):
        await pull_image(
            store, f"{reg.host}/app:1", allow_private_registries=[reg.host], credentials_file=creds
        )
    creds.write_text(json.dumps({"auths": {reg.host: {"auth": base64.b64encode(b"bob:hunter2").decode()}}}))
    installed = await pull_image(
        store, f"{reg.host}/app:1", allow_private_registries=[reg.host], credentials_file=creds
    )
    assert (installed.rootfs / "f").read_bytes() == b"basic"


async def test_corrupted_blob_installs_nothing(
    start_registry: Callable[..., Registry], store: ImageStore
) -> None:
    reg = start_registry()
    good = layer([Entry("good", b"fine")])
    bad = layer([Entry("data", os.urandom(1 << 20))], compress=False)
    image = build_image([good, bad])
    await push(reg.url, "corrupt", "1", image)
    data_path = reg.blob_data_path(image.layer_digests[1])
    corrupted = bytearray(data_path.read_bytes())
    corrupted[len(corrupted) // 2] ^= 0xFF
    data_path.write_bytes(bytes(corrupted))

    with pytest.raises(
        InvalidRequest, match=f"blob {image.layer_digests[1]} has content with digest sha256:"
    ):
        await pull_image(store, f"{reg.host}/corrupt:1", allow_private_registries=[reg.host])

    assert store.get(f"{reg.host}/corrupt:1") is None
    assert store.list() == []
    assert image.layer_digests[1].split(":")[1] not in blob_files(store), "no wrong blob kept"
    assert not [n for n in blob_files(store) if n.startswith(".tmp")], "no temporary file left"
    assert not [n for n in os.listdir(store.images_dir) if n.startswith((".tmp-", ".trash-"))]


async def test_interrupted_pull_then_retry(start_registry: Callable[..., Registry], proxy_factory: Any,
                                           store: ImageStore) -> None:  # fmt: skip
    reg = start_registry()
    big = layer([Entry("big", os.urandom(4 << 20))], compress=False)
    image = build_image([layer([Entry("small", b"s")]), big])
    await push(reg.url, "flaky", "1", image)
    proxy: Proxy = await proxy_factory(reg)
    big_digest = image.layer_digests[1]
    ref = f"{proxy.host}/flaky:1"

    # One attempt only: the cut connection fails the pull; nothing is installed or half-written.
    proxy.cuts[big_digest] = 1
    with pytest.raises(Unavailable, match=f"blob {big_digest}.*failed after 1 attempt"):
        await pull_image(store, ref, attempts=1, allow_private_registries=[proxy.host])
    assert store.get(ref) is None
    assert big_digest.split(":")[1] not in blob_files(store)
    assert not [n for n in blob_files(store) if n.startswith(".tmp")]

    # Pulling again succeeds.
    installed = await pull_image(store, ref, attempts=1, allow_private_registries=[proxy.host])
    assert (installed.rootfs / "big").stat().st_size == 4 << 20

    # With retries, one pull survives a cut and resumes where it stopped instead of starting over.
    store.remove(ref)
    assert collect_unused_blobs(store, blob_store(store.images_dir)) > 0
    proxy.cuts[big_digest] = 1
    proxy.ranges.clear()
    installed = await pull_image(store, ref, allow_private_registries=[proxy.host])
    assert installed.digest == image.digest
    assert len(proxy.ranges) == 1 and proxy.ranges[0].startswith("bytes=") and proxy.ranges[0] != "bytes=0-"


async def test_concurrent_pulls_are_joined(start_registry: Callable[..., Registry], proxy_factory: Any,
                                           store: ImageStore) -> None:  # fmt: skip
    reg = start_registry()
    image = build_image([layer([Entry("a", os.urandom(1 << 20))]), layer([Entry("b", b"b")])])
    await push(reg.url, "joined", "1", image)
    proxy: Proxy = await proxy_factory(reg)
    proxy.delay_secs = 0.3  # keeps the first pull busy while the others arrive
    seen: list[list[tuple[str, int, int]]] = [[], [], []]

    results = await asyncio.gather(*(
        pull_image(store, ref, progress=lambda *e, i=i: seen[i].append(e), allow_private_registries=[proxy.host])
        for i, ref in enumerate([f"{proxy.host}/joined:1"] * 3)
    ))  # fmt: skip

    assert results[0] == results[1] == results[2], "every caller gets the one install"
    assert proxy.manifest_gets == 1, "one resolve: the pulls ran as one"
    assert all(proxy.blob_gets[d] == 1 for d in image.layer_digests), proxy.blob_gets
    assert seen[0][-1] == seen[1][-1] == seen[2][-1] and seen[0][-1][0] == "building"
    assert all(any(e[0] == "pulling" for e in s) for s in seen), "every joined caller hears the progress"
    assert blob_files(store) == hexes(*image.layer_digests)


async def test_shared_layer_stored_once(start_registry: Callable[..., Registry], proxy_factory: Any,
                                        store: ImageStore) -> None:  # fmt: skip
    reg = start_registry()
    shared = layer([Entry("usr/share/base", os.urandom(1 << 20))])
    one = build_image([shared, layer([Entry("one", b"1")])])
    two = build_image([shared, layer([Entry("two", b"2")])])
    await push(reg.url, "one", "1", one)
    await push(reg.url, "two", "1", two)
    proxy: Proxy = await proxy_factory(reg)
    shared_digest = one.layer_digests[0]

    a, b = await asyncio.gather(
        pull_image(store, f"{proxy.host}/one:1", allow_private_registries=[proxy.host]),
        pull_image(store, f"{proxy.host}/two:1", allow_private_registries=[proxy.host]),
    )

    assert proxy.blob_gets[shared_digest] == 1, "the shared layer is fetched once"
    assert a.layers[0] == b.layers[0] == shared_digest
    assert blob_files(store) == hexes(shared_digest, one.layer_digests[1], two.layer_digests[1])
    assert (a.rootfs / "usr/share/base").read_bytes() == (b.rootfs / "usr/share/base").read_bytes()

    # A third image sharing it later does not fetch it again.
    three = build_image([shared, layer([Entry("three", b"3")])])
    await push(reg.url, "three", "1", three)
    await pull_image(store, f"{proxy.host}/three:1", allow_private_registries=[proxy.host])
    assert proxy.blob_gets[shared_digest] == 1

    # Layers go once no installed image records them.
    blobs: BlobStore = blob_store(store.images_dir)
    store.remove(f"{proxy.host}/one:1")
    assert collect_unused_blobs(store, blobs) == len(one.blobs[one.layer_digests[1]])
    assert shared_digest in blobs.digests()
    store.remove(f"{proxy.host}/two:1")
    store.remove(f"{proxy.host}/three:1")
    collect_unused_blobs(store, blobs)
    assert blob_files(store) == []


async def test_moved_tag_replaces_and_missing_image_is_not_found(
    start_registry: Callable[..., Registry], store: ImageStore
) -> None:
    reg = start_registry()
    v1 = build_image([layer([Entry("v", b"1")])])
    await push(reg.url, "moving", "latest", v1)
    first = await pull_image(store, f"{reg.host}/moving", allow_private_registries=[reg.host])
    v2 = build_image([layer([Entry("v", b"2")])])
    await push(reg.url, "moving", "latest", v2)
    second = await pull_image(store, f"{reg.host}/moving", allow_private_registries=[reg.host])
    assert (first.digest, second.digest) == (v1.digest, v2.digest)
    async with RegistryClient(allow_private_registries=[reg.host]) as client:
        assert await client.manifest_digest(parse_reference(f"{reg.host}/moving")) == v2.digest
    assert (second.rootfs / "v").read_bytes() == b"2"
    pinned = await pull_image(store, f"{reg.host}/moving@{v1.digest}", allow_private_registries=[reg.host])
    assert (pinned.rootfs / "v").read_bytes() == b"1"
    assert pinned.reference == f"{reg.host}/moving@{v1.digest}"

    with pytest.raises(NotFound, match="not found"):
        await pull_image(store, f"{reg.host}/moving:nope", allow_private_registries=[reg.host])
    with pytest.raises(NotFound, match="not found"):
        await pull_image(store, f"{reg.host}/nothing/here:1", allow_private_registries=[reg.host])
