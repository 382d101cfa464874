"""The SDK (async and sync) against a real sandboxd with gVisor sandboxes."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sandboxd_harness import Sandboxd

from sbx.api.errors import Conflict, InvalidRequest, NotFound, Refused, SandboxError, Unavailable
from sbx.client import AsyncClient, Sandbox
from sbx.client.sync import Client


@pytest.fixture
async def client(sandboxd: Sandboxd) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"unix://{sandboxd.socket_path}") as c:
        yield c


@pytest.fixture
async def box(client: AsyncClient, sandbox: dict[str, Any]) -> Sandbox:
    return await client.sandboxes.get(sandbox["id"])


async def test_create_get_list_delete(client: AsyncClient) -> None:
    made = await Sandbox.create(client, name="sdk-create", labels={"suite": "sdk"})
    try:
        assert made.id.startswith("sbx_")
        assert made.state == "running"
        assert (await client.sandboxes.get("sdk-create")).id == made.id
        assert [s.id for s in await client.sandboxes.list({"suite": "sdk"})] == [made.id]
        with pytest.raises(Conflict):
            await client.sandboxes.create(name="sdk-create")
    finally:
        await made.delete()
    assert (await made.refresh()).state == "terminated"
    await made.delete()  # idempotent


async def test_run(box: Sandbox) -> None:
    result = await box.run(["sh", "-c", "cat; echo err >&2; exit 3"], stdin=b"in\x00put")
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"in\x00put", b"err\n")
    timed = await box.run(["sleep", "30"], timeout_secs=1)
    assert timed.timed_out and timed.exit_code == -1


async def test_process_output_streams_while_running(box: Sandbox) -> None:
    proc = await box.start_process(["sh", "-c", "echo one; sleep 1; echo two >&2; exit 4"])
    assert proc.pid > 0 and proc.exit_code is None
    seen: list[tuple[str, bytes, float]] = []
    loop = asyncio.get_running_loop()
    async for event in proc.output():
        seen.append((event.stream, event.data, loop.time()))
    assert [(s, d) for s, d, _ in seen] == [("stdout", b"one\n"), ("stderr", b"two\n")]
    # The first line arrived before the process slept: the stream follows, it does not wait for the end.
    assert seen[1][2] - seen[0][2] > 0.5
    assert proc.exit_code == 4
    assert (await proc.refresh()).exit_code == 4
    assert [p.pid for p in await box.processes() if p.pid == proc.pid] == [proc.pid]


async def test_stdin_and_close(box: Sandbox) -> None:
    proc = await box.start_process(["sh", "-c", "wc -c"])
    await proc.write_stdin(b"x" * 1000)
    await proc.write_stdin(b"y" * 24, close=True)
    out = b"".join([e.data async for e in proc.output()])
    assert out.strip() == b"1024"
    assert proc.exit_code == 0


async def test_signal(box: Sandbox) -> None:
    proc = await box.start_process(["sleep", "60"])
    await proc.signal("TERM")
    code = await asyncio.wait_for(proc.wait(), 30)
    assert code != 0


async def test_files_round_trip_big_file(box: Sandbox) -> None:
    data = os.urandom(20 * 1024 * 1024)
    path = "/sandbox/home/sdk/big.bin"
    await box.files.write(path, data)
    assert hashlib.sha256(await box.files.read(path)).digest() == hashlib.sha256(data).digest()
    listed = {e.name: e for e in await box.files.list("/sandbox/home/sdk")}
    assert listed["big.bin"].type == "file" and listed["big.bin"].size == len(data)
    check = await box.run(["sha256sum", path])
    assert check.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    await box.files.write("/sandbox/home/sdk/t.txt", "héllo")
    assert await box.files.read_text("/sandbox/home/sdk/t.txt") == "héllo"
    await box.files.remove(path)
    with pytest.raises(NotFound):
        await box.files.read(path)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda c, b: c.sandboxes.get("no-such-sandbox"), NotFound),
        (lambda c, b: b.files.read("relative/path"), InvalidRequest),
        (lambda c, b: b.run(["no-such-command-xyz"]), InvalidRequest),
        (lambda c, b: b.get_process(999999), NotFound),
        (lambda c, b: c.sandboxes.create(bind="/"), InvalidRequest),
        (lambda c, b: b.files.remove("/sandbox/home"), Refused),
        (lambda c, b: c.sandboxes.create(env={"LD_PRELOAD": "x"}), Refused),
    ],
)
async def test_errors_map_to_classes(
    client: AsyncClient, box: Sandbox, call: Any, error: type[SandboxError]
) -> None:
    with pytest.raises(error):
        await call(client, box)


async def test_unreachable_server_is_unavailable(tmp_path: Any) -> None:
    async with AsyncClient(f"unix://{tmp_path}/absent.sock") as c:
        with pytest.raises(Unavailable, match="cannot reach sandboxd"):
            await c.capabilities()
        with pytest.raises(Unavailable, match="cannot reach sandboxd"):
            await c.upgrade("/v1/sandboxes/sbx_x/processes/1/attach", "sbx-stream/1")


async def test_events(box: Sandbox) -> None:
    await box.run(["true"])
    found = await box.events()
    assert "process.started" in {e["type"] for e in found.events}


def test_sync_wrapper(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    with Client(f"unix://{sandboxd.socket_path}") as client:
        box = client.sandboxes.get(sandbox["id"])
        assert box.id == sandbox["id"]
        assert box.run(["echo", "hi"]).stdout == b"hi\n"
        proc = box.start_process(["sh", "-c", "echo a; echo b"])
        assert b"".join(e.data for e in proc.output()) == b"a\nb\n"
        assert proc.exit_code == 0
        box.files.write("/sandbox/home/sync.txt", b"s")
        assert box.files.read("/sandbox/home/sync.txt") == b"s"
        assert [e.name for e in box.files.list("/sandbox/home") if e.name == "sync.txt"] == ["sync.txt"]
        with pytest.raises(NotFound):
            client.sandboxes.get("no-such-sandbox")
    with pytest.raises(RuntimeError, match="closed"):
        client.capabilities()
