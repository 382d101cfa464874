"""The Backend contract (sbx/backends/base.py), run against every backend: gVisor and the fake one
(tests/support/fake_backend.py). What it checks is what the node relies on: a booted sandbox's agent answers
as the backend's guest user; destroy is idempotent; a failed boot leaves nothing; counters exist exactly while
a sandbox runs; a sandbox created with network mode none cannot be given a network; volumes keep their
contents across attach and detach, which are idempotent; a parked sandbox uses no CPU, its agent answers only
once it is unparked, and it goes on where it stood; park and unpark are idempotent and a parked sandbox is still
running and can be destroyed."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from fake_backend import FakeBackend
from sandboxd_harness import AGENT_PATH, IMAGES_DIR, RUNSC

from sbx.agent.client import AgentClient
from sbx.api.network_policy import NetworkPolicy
from sbx.backends.base import Backend, BackendError, BootSpec
from sbx.backends.gvisor import GVisorBackend
from sbx.images.default_image import DEFAULT_IMAGE
from sbx.images.store import ImageStore

KINDS = ("gvisor", "fake")


def _image_root() -> Path:
    image = ImageStore(IMAGES_DIR).get(DEFAULT_IMAGE)
    assert image is not None, f"the default image is not installed in {IMAGES_DIR}: run scripts/install.sh"
    return image.rootfs


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """The backend's state directory: a short one of its own, not under tmp_path, since the agent's unix socket
    in it must stay within the 107 bytes of a socket path and a parallel worker's tmp_path is longer
    (``.../popen-gw0/<test name>/``)."""
    parent = Path(tempfile.mkdtemp(prefix="sbxbc-", dir="/var/tmp"))
    (parent / "state").mkdir()
    yield parent / "state"
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(params=KINDS)
async def backend(request: pytest.FixtureRequest, state_dir: Path) -> AsyncIterator[Backend]:
    made: Backend
    if request.param == "gvisor":
        made = GVisorBackend(state_dir, AGENT_PATH, runsc=RUNSC)
    else:
        made = FakeBackend(state_dir, AGENT_PATH)
    made.check()
    await made.start()
    yield made
    await made.close()


def _spec(**changes: object) -> BootSpec:
    fields: dict[str, object] = {
        "sandbox_id": f"sbx_{uuid.uuid4().hex[:16]}", "image_root": _image_root(), "cpus": 1,
        "memory_mb": 256, "disk_mb": 256, "network": NetworkPolicy(mode="none"),
    }  # fmt: skip
    fields.update(changes)
    return BootSpec(**fields)  # type: ignore[arg-type]


class _Output:
    """A process's stdout and exit code, as the agent delivers them."""

    def __init__(self) -> None:
        self.stdout = b""
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_output(self, stream: str, data: bytes) -> None:
        if stream == "stdout":
            self.stdout += data

    async def on_exit(self, exit_code: int) -> None:
        self.exited.set_result(exit_code)


async def _run(agent: AgentClient, backend: Backend, argv: list[str], handle: int = 1) -> bytes:
    """stdout of ``argv`` run as the backend's guest user in its home."""
    guest = backend.guest
    out = _Output()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": guest.home}
    await agent.list_processes()
    await agent.spawn(handle, argv, env, guest.home, guest.uid, guest.gid, sink=out)
    assert await asyncio.wait_for(out.exited, 30) == 0, out.stdout
    return out.stdout


async def test_a_booted_sandbox_runs_as_the_guest_user_until_destroyed(backend: Backend) -> None:
    spec = _spec()
    await backend.boot(spec)
    try:
        assert await backend.is_running(spec.sandbox_id)
        agent = await backend.connect_agent(spec.sandbox_id, 10)
        try:
            out = await _run(agent, backend, ["sh", "-c", "id -u; id -g; pwd"])
        finally:
            await agent.close()
        guest = backend.guest
        assert out.decode().split() == [str(guest.uid), str(guest.gid), guest.home]
        second = await backend.connect_agent(spec.sandbox_id, 10)  # any number of connections
        try:  # some CPU time for the counters to show
            await _run(second, backend, ["sh", "-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"], 2)
        finally:
            await second.close()
        usage = await backend.usage(spec.sandbox_id)
        assert usage is not None and usage.cpu_ns > 0 and usage.memory_bytes > 0
    finally:
        await backend.destroy(spec.sandbox_id)
    assert not await backend.is_running(spec.sandbox_id)
    assert await backend.usage(spec.sandbox_id) is None
    await backend.destroy(spec.sandbox_id)  # idempotent
    await backend.destroy(f"sbx_{uuid.uuid4().hex[:16]}")  # one never booted: not an error


async def test_a_failed_boot_leaves_nothing(backend: Backend, state_dir: Path, tmp_path: Path) -> None:
    before = sorted(p.relative_to(state_dir) for p in state_dir.rglob("*"))
    spec = _spec(image_root=tmp_path / "no-such-image")
    with pytest.raises(BackendError):
        await backend.boot(spec)
    assert not await backend.is_running(spec.sandbox_id)
    after = sorted(p.relative_to(state_dir) for p in state_dir.rglob("*"))
    assert [p for p in after if spec.sandbox_id in str(p)] == []
    assert set(after) - set(before) <= {p for p in after if p.name in ("runsc",)}


async def test_a_sandbox_without_a_network_cannot_be_given_one(backend: Backend) -> None:
    spec = _spec()
    await backend.boot(spec)
    try:
        with pytest.raises(BackendError):
            await backend.update_network(spec.sandbox_id, NetworkPolicy(mode="open"))
        assert await backend.is_running(spec.sandbox_id)  # the refusal changed nothing
    finally:
        await backend.destroy(spec.sandbox_id)


async def test_volumes_keep_their_contents_across_attach_and_detach(backend: Backend, tmp_path: Path) -> None:
    directory = tmp_path / "volume"
    directory.mkdir()
    disks = backend.volumes
    await disks.create(directory, 16)
    assert not disks.is_attached(directory)
    source = await disks.attach(directory)
    assert await disks.attach(directory) == source and disks.is_attached(directory)  # idempotent
    st = os.stat(source)
    assert (st.st_uid, st.st_gid) == (backend.guest.uid, backend.guest.gid)
    assert os.listdir(source) == []  # a new volume is empty
    (source / "kept").write_bytes(b"contents")
    await disks.flush(directory)
    await disks.detach(directory)
    await disks.detach(directory)  # idempotent
    assert not disks.is_attached(directory)
    source = await disks.attach(directory)
    try:
        assert (source / "kept").read_bytes() == b"contents"
    finally:
        await disks.detach(directory)


async def _cpu_ns(backend: Backend, sandbox_id: str) -> int:
    usage = await backend.usage(sandbox_id)
    assert usage is not None
    return usage.cpu_ns


async def test_a_parked_sandbox_uses_no_cpu_and_goes_on_where_it_stood(backend: Backend) -> None:
    spec = _spec()
    await backend.boot(spec)
    sandbox_id = spec.sandbox_id
    agent = await backend.connect_agent(sandbox_id, 10)
    try:
        await backend.unpark(sandbox_id)  # idempotent: a sandbox that is not parked is left as it is
        assert not await backend.is_parked(sandbox_id)
        # A guest process that uses CPU all the time: while parked it must not.
        guest = backend.guest
        spinner = _Output()
        await agent.list_processes()
        await agent.spawn(1, ["sh", "-c", "while :; do :; done"], {"PATH": "/usr/bin:/bin"}, guest.home,
                          guest.uid, guest.gid, sink=spinner)  # fmt: skip
        before = await _cpu_ns(backend, sandbox_id)
        await asyncio.sleep(0.5)
        assert await _cpu_ns(backend, sandbox_id) > before  # it spins while awake

        await backend.park(sandbox_id)
        await backend.park(sandbox_id)  # idempotent
        assert await backend.is_parked(sandbox_id)
        # Still running, answered at once (runsc would wait for the thaw: is_running must not ask it).
        assert await asyncio.wait_for(backend.is_running(sandbox_id), 10)
        parked_at = await _cpu_ns(backend, sandbox_id)
        pending = asyncio.create_task(agent.list_processes())
        await asyncio.sleep(1.0)
        assert await _cpu_ns(backend, sandbox_id) == parked_at  # not a nanosecond
        assert not pending.done()  # the agent does not answer while parked

        await backend.unpark(sandbox_id)
        await backend.unpark(sandbox_id)  # idempotent
        assert not await backend.is_parked(sandbox_id)
        processes = await asyncio.wait_for(pending, 10)  # answered once unparked
        assert [p.exit_code for p in processes if p.handle == 1] == [None]  # the spinner goes on
        assert not spinner.exited.done()
        await asyncio.sleep(0.3)
        assert await _cpu_ns(backend, sandbox_id) > parked_at
        await agent.signal(1, 9)
        assert await asyncio.wait_for(spinner.exited, 30) != 0
    finally:
        await agent.close()
        await backend.destroy(sandbox_id)


async def test_a_parked_sandbox_is_destroyed_like_any_other(backend: Backend) -> None:
    spec = _spec()
    await backend.boot(spec)
    await backend.park(spec.sandbox_id)
    try:
        assert await backend.is_parked(spec.sandbox_id)
    finally:
        await asyncio.wait_for(
            backend.destroy(spec.sandbox_id), 60
        )  # never waits for a thaw that never comes
    assert not await backend.is_running(spec.sandbox_id)
    assert not await backend.is_parked(spec.sandbox_id)
    assert await backend.usage(spec.sandbox_id) is None
    never = f"sbx_{uuid.uuid4().hex[:16]}"
    await backend.unpark(never)  # a sandbox that is not there: nothing to do
    assert not await backend.is_parked(never)
    with pytest.raises(BackendError):
        await backend.park(never)  # and nothing parked
