"""splice.py: the proxy's in-kernel relay between two TCP sockets (loopback pairs here)."""

from __future__ import annotations

import asyncio
import os
import socket
import struct

import pytest

from sbx.net.splice import SpliceRelay


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        one = socket.create_connection(listener.getsockname())
        two, _ = listener.accept()
    for sock in (one, two):
        sock.setblocking(False)
    return one, two


async def read_all(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    chunks = []
    while chunk := await loop.sock_recv(sock, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


async def test_relays_both_ways_with_half_closes() -> None:
    loop = asyncio.get_running_loop()
    client, a = tcp_pair()
    b, server = tcp_pair()
    relay = SpliceRelay(a, b)
    upload, download = os.urandom(3 << 20), os.urandom(5 << 20)

    async def client_side() -> bytes:
        await loop.sock_sendall(client, upload)
        client.shutdown(socket.SHUT_WR)  # the half-close must reach the server
        return await read_all(client)

    async def server_side() -> bytes:
        received = await read_all(server)
        await loop.sock_sendall(server, download)
        server.shutdown(socket.SHUT_WR)
        return received

    got_download, got_upload = await asyncio.wait_for(asyncio.gather(client_side(), server_side()), 30)
    await asyncio.wait_for(relay.wait(), 5)
    assert got_upload == upload and got_download == download
    for sock in (client, a, b, server):
        sock.close()


async def test_stop_ends_the_relay_at_once() -> None:
    client, a = tcp_pair()
    b, server = tcp_pair()
    relay = SpliceRelay(a, b)
    waiting = asyncio.create_task(relay.wait())
    await asyncio.sleep(0.05)
    assert not waiting.done()  # nobody said anything: still relaying
    relay.stop()
    await asyncio.wait_for(waiting, 1)
    relay.stop()  # idempotent
    for sock in (client, a, b, server):
        sock.close()


async def test_a_reset_peer_fails_the_relay() -> None:
    loop = asyncio.get_running_loop()
    client, a = tcp_pair()
    b, server = tcp_pair()
    relay = SpliceRelay(a, b)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    server.close()  # a reset towards b
    await asyncio.sleep(0.05)
    await loop.sock_sendall(client, b"x" * 65536)  # relayed towards the reset side
    with pytest.raises(OSError):
        await asyncio.wait_for(relay.wait(), 5)
    for sock in (client, a, b):
        sock.close()
