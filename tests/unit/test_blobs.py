"""The blob store: verified writes, joined fetches, nothing half-written, garbage collection."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from sbx.api.errors import InvalidRequest
from sbx.images.blobs import BlobStore, BlobWriter, DigestMismatch, SingleFlight, collect_unused_blobs
from sbx.images.store import ImageStore


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def entries(store: BlobStore) -> list[str]:
    return sorted(os.listdir(store.root)) if store.root.is_dir() else []


async def test_ensure_writes_verifies_and_reuses(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = os.urandom(300_000)
    calls = 0

    async def fill(writer: BlobWriter) -> None:
        nonlocal calls
        calls += 1
        for i in range(0, len(data), 65536):
            writer.write(data[i : i + 65536])
            await asyncio.sleep(0)

    path = await store.ensure(digest_of(data), len(data), fill)
    assert path == tmp_path / "blobs" / "sha256" / digest_of(data).split(":")[1]
    assert path.read_bytes() == data
    assert path.stat().st_mode & 0o777 == 0o444
    assert await store.ensure(digest_of(data), len(data), fill) == path
    assert calls == 1, "a stored blob is not fetched again"
    assert store.has(digest_of(data)) and store.size(digest_of(data)) == len(data)
    assert store.digests() == {digest_of(data)}
    assert entries(store) == [path.name], "no temporary file left"


@pytest.mark.parametrize(
    ("content", "size", "message"),
    [
        (b"other content", None, "has content with digest"),
        (b"expected", 5, "larger than the 5 bytes"),
        (b"expected", 100, "ended after 8 bytes"),
    ],
)
async def test_wrong_content_keeps_nothing(
    tmp_path: Path, content: bytes, size: int | None, message: str
) -> None:
    store = BlobStore(tmp_path)

    async def fill(writer: BlobWriter) -> None:
        writer.write(content)

    with pytest.raises(DigestMismatch, match=message):
        await store.ensure(digest_of(b"expected"), size, fill)
    assert isinstance(DigestMismatch("x"), InvalidRequest)
    assert entries(store) == []


async def test_failed_fill_keeps_nothing(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)

    async def fill(writer: BlobWriter) -> None:
        writer.write(b"half")
        raise ConnectionResetError("cut")

    with pytest.raises(ConnectionResetError):
        await store.ensure(digest_of(b"half and half"), 13, fill)
    assert entries(store) == []


async def test_restart_drops_what_was_written(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = b"the real content"

    async def fill(writer: BlobWriter) -> None:
        writer.write(b"garbage that a server sent before ignoring our range")
        writer.restart()
        writer.write(data)

    path = await store.ensure(digest_of(data), None, fill)
    assert path.read_bytes() == data


async def test_concurrent_fetches_of_one_digest_are_joined(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = os.urandom(1000)
    calls = 0
    release = asyncio.Event()

    async def fill(writer: BlobWriter) -> None:
        nonlocal calls
        calls += 1
        await release.wait()
        writer.write(data)

    tasks = [asyncio.create_task(store.ensure(digest_of(data), len(data), fill)) for _ in range(5)]
    await asyncio.sleep(0.01)
    release.set()
    paths = await asyncio.gather(*tasks)
    assert calls == 1
    assert len(set(paths)) == 1


async def test_joined_callers_share_the_error(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)

    async def fill(writer: BlobWriter) -> None:
        await asyncio.sleep(0.01)
        writer.write(b"wrong")

    results = await asyncio.gather(
        *(store.ensure(digest_of(b"right"), None, fill) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, DigestMismatch) for r in results)
    assert entries(store) == []


async def test_single_flight_cancels_only_when_every_caller_is_gone() -> None:
    flight: SingleFlight[str, int] = SingleFlight()
    started = asyncio.Event()
    finish = asyncio.Event()

    async def work() -> int:
        started.set()
        await finish.wait()
        return 7

    a = asyncio.create_task(flight.run("k", work))
    b = asyncio.create_task(flight.run("k", work))
    await started.wait()
    a.cancel()
    await asyncio.sleep(0)
    finish.set()
    assert await b == 7, "one caller's cancel does not fail the other"
    with pytest.raises(asyncio.CancelledError):
        await a
    assert not flight.running("k")

    finish.clear()
    started.clear()
    c = asyncio.create_task(flight.run("k", work))
    await started.wait()
    c.cancel()
    with pytest.raises(asyncio.CancelledError):
        await c
    await asyncio.sleep(0)
    assert not flight.running("k"), "the last caller's cancel stops the work"


def test_invalid_digest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="only sha256"):
        BlobStore(tmp_path).path("sha256:../../etc/passwd")
    with pytest.raises(InvalidRequest, match="only sha256"):
        BlobStore(tmp_path).path("md5:" + "a" * 32)


async def test_garbage_collection_keeps_recorded_and_pinned_blobs(tmp_path: Path) -> None:
    images = ImageStore(tmp_path / "images")
    blobs = BlobStore(images.images_dir)
    payloads = {name: os.urandom(1000 + i) for i, name in enumerate(["recorded", "pinned", "unused"])}
    digests = {name: digest_of(data) for name, data in payloads.items()}
    for name, data in payloads.items():

        async def fill(writer: BlobWriter, data: bytes = data) -> None:
            writer.write(data)

        await blobs.ensure(digests[name], len(data), fill)

    def build(root: Path) -> None:
        (root / "f").write_text("x")

    images.install_rootfs("img", build, layers=[digests["recorded"]])
    stale = blobs.root / ".tmp-dead-download"
    stale.write_bytes(b"x" * 10)
    old = time.time() - 7200
    os.utime(stale, (old, old))
    fresh = blobs.root / ".tmp-live-download"
    fresh.write_bytes(b"y")

    with blobs.pinned([digests["pinned"]]):
        freed = collect_unused_blobs(images, blobs)
        assert freed == len(payloads["unused"]) + 10
        assert blobs.digests() == {digests["recorded"], digests["pinned"]}
    assert fresh.exists() and not stale.exists()
    assert collect_unused_blobs(images, blobs) == len(payloads["pinned"])
    images.remove("img")
    assert collect_unused_blobs(images, blobs) == len(payloads["recorded"])
    assert blobs.digests() == set()
    assert images.list() == [], "the blobs directory is never listed as an image"


def _pin_in_child(images_dir: Path, digest: str, conn: Connection) -> None:
    """A pull under way in another process: its pins held until the parent says (or it dies). A pipe, not
    events: a process killed inside an Event's wait would leave its lock taken."""
    with BlobStore(images_dir).pinned([digest]):
        conn.send("pinned")
        conn.recv()


@pytest.mark.parametrize("ending", ["exits", "is killed"])
async def test_a_pull_in_another_process_keeps_its_blobs_until_it_ends(tmp_path: Path, ending: str) -> None:
    images = ImageStore(tmp_path / "images")
    blobs = BlobStore(images.images_dir)
    data = os.urandom(2000)
    digest = digest_of(data)

    async def fill(writer: BlobWriter) -> None:
        writer.write(data)

    await blobs.ensure(digest, len(data), fill)
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_pin_in_child, args=(images.images_dir, digest, theirs))
    child.start()
    try:
        assert ours.poll(30) and ours.recv() == "pinned"
        # The other process's pull holds it: this process's collection keeps it, twice over.
        assert collect_unused_blobs(images, blobs) == 0
        assert collect_unused_blobs(images, blobs) == 0 and blobs.digests() == {digest}
        if ending == "exits":
            ours.send("done")
        else:
            child.kill()  # its pin file stays behind; its lock does not
        child.join(30)
        assert collect_unused_blobs(images, blobs) == len(data)
        assert blobs.digests() == set()
        assert not [n for n in os.listdir(blobs.root) if n.startswith(".pins-")], (
            "a dead owner's pins are removed"
        )
    finally:
        child.kill()
        child.join(30)


def test_pins_are_published_only_while_held(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    one, two = digest_of(b"1"), digest_of(b"2")

    def published() -> list[str]:
        return sorted(
            line
            for name in os.listdir(blobs.root.parent)
            if name.startswith(".pins-")
            for line in (blobs.root.parent / name).read_text().split()
        )

    with blobs.pinned([one]):
        assert published() == [one]
        with blobs.pinned([one, two]):
            assert published() == sorted([one, two])
        assert published() == [one]
    assert published() == []
