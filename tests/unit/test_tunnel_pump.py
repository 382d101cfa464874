"""The tunnel's copy loop: a half-closed client's tunnel ends when the guest stays silent, and not before."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

from sbx.node.routes.tunnel import _pump, _splice
from sbx.web.upgrade import RawStream


class SilentGuest:
    """A guest connection that sends ``chunks`` (one every ``every`` seconds), then nothing, never closing."""

    def __init__(self, chunks: int = 0, every: float = 0.0) -> None:
        self.chunks, self.every = chunks, every
        self.received = b""
        self.eof = False

    async def read(self) -> bytes:
        if self.chunks:
            self.chunks -= 1
            await asyncio.sleep(self.every)
            return b"tick"
        await asyncio.Event().wait()  # silent for ever
        return b""

    async def write(self, data: bytes) -> None:
        self.received += data

    async def write_eof(self) -> None:
        self.eof = True


async def _client_pair() -> tuple[RawStream, socket.socket]:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    return RawStream(reader, writer), theirs


async def test_a_half_closed_tunnel_ends_after_the_guest_is_silent() -> None:
    stream, peer = await _client_pair()
    guest = SilentGuest()
    peer.sendall(b"request")
    peer.shutdown(socket.SHUT_WR)
    started = time.monotonic()
    await asyncio.wait_for(_pump(guest, stream, lambda: None, half_closed_idle_secs=0.3), 5)  # type: ignore[arg-type]
    assert 0.25 <= time.monotonic() - started < 3
    assert guest.received == b"request" and guest.eof  # the half-close was passed through first
    peer.close()


async def test_a_guest_still_answering_keeps_a_half_closed_tunnel() -> None:
    stream, peer = await _client_pair()
    guest = SilentGuest(chunks=6, every=0.1)  # 0.6 s of answers, each within the 0.3 s allowance
    peer.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(_pump(guest, stream, lambda: None, half_closed_idle_secs=0.3), 5)  # type: ignore[arg-type]
    peer.setblocking(False)
    got = b""
    while True:
        try:
            chunk = peer.recv(1024)
        except BlockingIOError:
            break
        if not chunk:
            break
        got += chunk
    assert got == b"tick" * 6
    peer.close()


async def test_an_open_client_keeps_a_silent_tunnel() -> None:
    stream, peer = await _client_pair()
    task = asyncio.create_task(_pump(SilentGuest(), stream, lambda: None, half_closed_idle_secs=0.1))  # type: ignore[arg-type]
    await asyncio.sleep(0.4)
    assert not task.done()  # no EOF from the client: silence on both sides is an idle tunnel, kept
    peer.close()  # a client that goes away ends it
    await asyncio.wait_for(task, 5)


# ---- the same rules for a raw tunnel relayed in the kernel (_splice) ------------------------------------------


def _plain_pairs() -> tuple[socket.socket, socket.socket, socket.socket, socket.socket]:
    """(client end for _splice, the client's peer, guest end for _splice, the guest's peer)."""
    client, client_peer = socket.socketpair()
    guest, guest_peer = socket.socketpair()
    for s in (client, guest):
        s.setblocking(False)
    for s in (client_peer, guest_peer):
        s.settimeout(5)
    return client, client_peer, guest, guest_peer


async def test_a_half_closed_spliced_tunnel_ends_after_the_guest_is_silent() -> None:
    client, client_peer, guest, guest_peer = _plain_pairs()
    touched: list[float] = []
    client_peer.sendall(b"request")
    client_peer.shutdown(socket.SHUT_WR)
    started = time.monotonic()
    await asyncio.wait_for(_splice(guest, client, lambda: touched.append(1), half_closed_idle_secs=0.3), 5)
    assert 0.25 <= time.monotonic() - started < 3
    assert (
        guest_peer.recv(100) == b"request" and guest_peer.recv(100) == b""
    )  # the half-close passed on first
    assert touched  # the client's bytes count as activity
    for s in (client, client_peer, guest, guest_peer):
        s.close()


async def test_a_guest_still_answering_keeps_a_half_closed_spliced_tunnel() -> None:
    client, client_peer, guest, guest_peer = _plain_pairs()
    client_peer.shutdown(socket.SHUT_WR)

    async def answer() -> None:
        for _ in range(6):  # 0.6 s of answers, each within the 0.3 s allowance
            await asyncio.sleep(0.1)
            guest_peer.sendall(b"tick")

    answering = asyncio.create_task(answer())
    await asyncio.wait_for(_splice(guest, client, lambda: None, half_closed_idle_secs=0.3), 5)
    await answering
    got = b""
    client_peer.settimeout(0.5)
    with contextlib.suppress(TimeoutError):
        while chunk := client_peer.recv(1024):
            got += chunk
    assert got == b"tick" * 6
    for s in (client, client_peer, guest, guest_peer):
        s.close()


async def test_an_open_client_keeps_a_silent_spliced_tunnel() -> None:
    client, client_peer, guest, guest_peer = _plain_pairs()
    task = asyncio.create_task(_splice(guest, client, lambda: None, half_closed_idle_secs=0.1))
    await asyncio.sleep(0.4)
    assert not task.done()  # no EOF from the client: an idle tunnel, kept
    client_peer.close()  # a client that goes away ends it
    await asyncio.wait_for(task, 5)
    for s in (client, guest, guest_peer):
        s.close()


class LateGuest(SilentGuest):
    """A guest silent while it reads the upload, that answers once the upload has ended."""

    def __init__(self) -> None:
        super().__init__()
        self.answered = False

    async def read(self) -> bytes:
        while not self.eof:
            await asyncio.sleep(0.01)
        if not self.answered:
            self.answered = True
            await asyncio.sleep(0.1)  # well within the allowance, counted from the EOF
            return b"answer"
        return b""


async def test_the_silence_after_the_clients_eof_counts_from_the_eof() -> None:
    """An upload longer than the allowance, with the guest silent throughout, then its answer: delivered."""
    stream, peer = await _client_pair()
    guest = LateGuest()

    async def upload() -> None:
        for _ in range(6):  # 0.6 s of upload, twice the 0.3 s allowance
            peer.sendall(b"x" * 1000)
            await asyncio.sleep(0.1)
        peer.shutdown(socket.SHUT_WR)

    uploading = asyncio.create_task(upload())
    await asyncio.wait_for(_pump(guest, stream, lambda: None, half_closed_idle_secs=0.3), 5)  # type: ignore[arg-type]
    await uploading
    peer.settimeout(1)
    got = b""
    with contextlib.suppress(TimeoutError):
        while chunk := peer.recv(1024):
            got += chunk
    assert got == b"answer" and len(guest.received) == 6000
    peer.close()


async def test_the_silence_after_the_clients_eof_counts_from_the_eof_when_spliced() -> None:
    client, client_peer, guest, guest_peer = _plain_pairs()

    async def upload() -> None:
        for _ in range(6):
            client_peer.sendall(b"x" * 1000)
            await asyncio.sleep(0.1)
        client_peer.shutdown(socket.SHUT_WR)

    async def late_guest() -> None:
        got = b""
        while chunk := await asyncio.to_thread(guest_peer.recv, 65536):
            got += chunk
        assert len(got) == 6000
        await asyncio.sleep(0.1)
        guest_peer.sendall(b"answer")

    tasks = [asyncio.create_task(upload()), asyncio.create_task(late_guest())]
    await asyncio.wait_for(_splice(guest, client, lambda: None, half_closed_idle_secs=0.3), 5)
    await asyncio.gather(*tasks)
    client_peer.settimeout(1)
    got = b""
    with contextlib.suppress(TimeoutError):
        while chunk := client_peer.recv(1024):
            got += chunk
    assert got == b"answer"
    for s in (client, client_peer, guest, guest_peer):
        s.close()
