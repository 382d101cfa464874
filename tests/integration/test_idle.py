"""Idle timeout: no request naming the sandbox and no process running -> terminated, reason idle.

A request names its sandbox for as long as it lasts: a tunnel in use, an attach (both transports), followed
output and a file transfer each keep a sandbox with a 2 s idle timeout running for 2.5 times that, and the idle
time counts from the end of the last one (docs/node-api.md, "Idle timeout"). The state is read from the listing,
which names no sandbox (reading one sandbox would be activity itself). Waits are on conditions, except where the
point is that time passes under a request in progress.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import os
import socket
import threading
import time
from collections.abc import Iterator

from sandboxd_harness import Sandboxd, UnixHTTPConnection
from test_attach import Attached, start
from test_tunnel import open_tunnel

from sbx.api import frames

#: The sandboxes' idle timeout, in seconds.
IDLE_SECS = 2
#: How long each long request lasts, in seconds: long past the idle timeout.
HELD_SECS = 2.5 * IDLE_SECS
#: Output and files big enough that no socket buffer holds them: a client that does not read keeps the
#: server's side of the request waiting, in progress.
BIG_BYTES = 8 * 1024 * 1024
WAIT_SECS = 30.0


def states(server: Sandboxd) -> dict[str, str]:
    """Every sandbox's state, from the listing (which is no activity of any sandbox)."""
    return {s["id"]: s["state"] for s in server.request("GET", "/v1/sandboxes").json()["sandboxes"]}


def stays_running(server: Sandboxd, ref: str, secs: float, since: float) -> None:
    """Poll for ``secs`` seconds, failing as soon as ``ref`` is not running (``since``: when the request began)."""
    deadline = time.monotonic() + secs
    while (now := time.monotonic()) < deadline:
        state = states(server)[ref]
        assert state == "running", f"{ref} {state} {now - since:.1f} s into a request in progress"
        time.sleep(min(0.2, max(0.0, deadline - now)))


def idles_out_after(server: Sandboxd, ref: str, ended_at: float) -> None:
    """Running right after the last request ended (at ``ended_at``), then terminated for idleness, no sooner
    than the idle timeout after that end."""
    assert states(server)[ref] == "running"
    while (state := states(server)[ref]) == "running":
        assert time.monotonic() < ended_at + IDLE_SECS + WAIT_SECS, f"{ref} never idled out"
        time.sleep(0.1)
    assert state == "terminated"
    # Not counted from the request's start (that would be long past) but from its end; a little slack for the
    # server noticing the end after the client made it.
    assert time.monotonic() - ended_at >= IDLE_SECS - 0.5
    events = server.request("GET", f"/v1/sandboxes/{ref}/events").json()["events"]
    assert events[-1]["type"] == "sandbox.terminated" and events[-1]["reason"] == "idle"


def wait_exited(server: Sandboxd, ref: str, pid: int) -> None:
    deadline = time.monotonic() + WAIT_SECS
    while server.request("GET", f"/v1/sandboxes/{ref}/processes/{pid}").json()["state"] != "exited":
        assert time.monotonic() < deadline, f"process {pid} did not exit"
        time.sleep(0.05)


def big_output(server: Sandboxd, ref: str) -> int:
    """The pid of an exited process that printed BIG_BYTES: replaying it takes as long as its reader wants."""
    pid = start(server, ref, ["head", "-c", str(BIG_BYTES), "/dev/zero"])
    wait_exited(server, ref, pid)
    return pid


def paused_get(server: Sandboxd, path: str) -> http.client.HTTPResponse:
    """A GET whose answer has begun and that then reads nothing (the server waits on the client)."""
    conn = UnixHTTPConnection(server.socket_path, timeout=WAIT_SECS)
    conn.request("GET", path)
    response = conn.getresponse()
    assert response.status == 200, response.read()
    return response


def paused_websocket(server: Sandboxd, path: str) -> socket.socket:
    """A WebSocket attach switched over, from which nothing is read afterwards."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(WAIT_SECS)
    sock.connect(str(server.socket_path))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n"
        f"Sec-WebSocket-Protocol: {frames.WEBSOCKET_PROTOCOL}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 101 "), head
    return sock


def test_idle_timeout_terminates(sandboxd: Sandboxd) -> None:
    idle = sandboxd.create(idle_timeout_secs=IDLE_SECS)
    busy = sandboxd.create(idle_timeout_secs=IDLE_SECS)
    sandboxd.request("POST", f"/v1/sandboxes/{busy['id']}/processes", {"argv": ["sleep", "6"]})
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        found = states(sandboxd)
        if found[idle["id"]] == "terminated":
            break
        time.sleep(0.1)
    assert found[idle["id"]] == "terminated"
    # A running process keeps a sandbox alive past its idle timeout.
    assert found[busy["id"]] == "running"
    events = sandboxd.request("GET", f"/v1/sandboxes/{idle['id']}/events").json()["events"]
    assert events[-1]["type"] == "sandbox.terminated" and events[-1]["reason"] == "idle"


# A dev server's stand-in, started as a daemon (no API process keeps the sandbox busy): to each connection it
# sends a line every 0.2 s until the connection goes. Data flows from the guest only, as in a download.
TICKER = r"""
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1]))); srv.listen(4)
while True:
    conn, _ = srv.accept()
    try:
        while True:
            conn.sendall(b"tick\n"); time.sleep(0.2)
    except OSError:
        conn.close()
"""


def test_an_open_tunnel_keeps_the_sandbox_from_idling_out(sandboxd: Sandboxd) -> None:
    ref = sandboxd.create(idle_timeout_secs=IDLE_SECS)["id"]
    put = sandboxd.request("PUT", f"/v1/sandboxes/{ref}/files?path=/tmp/ticker.py", body=TICKER.encode())
    assert put.status == 204
    daemon = sandboxd.run(ref, ["sh", "-c", "python3 /tmp/ticker.py 8300 </dev/null >/dev/null 2>&1 &"])
    assert daemon["exit_code"] == 0
    deadline = time.monotonic() + WAIT_SECS
    while True:  # until the daemon listens (a refusal is answered before the switch)
        sock, head = open_tunnel(sandboxd, ref, 8300)
        if head.startswith(b"HTTP/1.1 101"):
            break
        sock.close()
        assert time.monotonic() < deadline, head
        time.sleep(0.05)
    received = [len(head.split(b"\r\n\r\n", 1)[1])]

    def read() -> None:
        with contextlib.suppress(OSError):
            while chunk := sock.recv(4096):
                received[0] += len(chunk)

    reader = threading.Thread(target=read, daemon=True)
    began = time.monotonic()
    reader.start()
    try:
        stays_running(sandboxd, ref, HELD_SECS, began)
        assert received[0] >= len(b"tick\n") * 10  # in use all along
    finally:
        sock.shutdown(socket.SHUT_RDWR)  # the reader sees the end
        ended = time.monotonic()
        reader.join(WAIT_SECS)
        sock.close()
    idles_out_after(sandboxd, ref, ended)


def test_an_attach_keeps_the_sandbox_from_idling_out_on_either_transport(sandboxd: Sandboxd) -> None:
    ref = sandboxd.create(idle_timeout_secs=IDLE_SECS)["id"]
    pid = big_output(sandboxd, ref)
    began = time.monotonic()
    raw = Attached(sandboxd, ref, pid)  # reads the 101 only: the replay waits on it
    assert raw.head.startswith("HTTP/1.1 101")
    stays_running(sandboxd, ref, HELD_SECS / 2, began)
    ws = paused_websocket(sandboxd, f"/v1/sandboxes/{ref}/processes/{pid}/attach/websocket")
    stays_running(sandboxd, ref, HELD_SECS / 2, began)
    raw.close()  # the WebSocket alone holds it from here, longer than the idle timeout
    stays_running(sandboxd, ref, HELD_SECS / 2, began)
    ws.close()
    idles_out_after(sandboxd, ref, time.monotonic())


def test_followed_output_keeps_the_sandbox_from_idling_out(sandboxd: Sandboxd) -> None:
    ref = sandboxd.create(idle_timeout_secs=IDLE_SECS)["id"]
    pid = big_output(sandboxd, ref)
    began = time.monotonic()
    response = paused_get(sandboxd, f"/v1/sandboxes/{ref}/processes/{pid}/output")
    assert response.readline().startswith(b'{"stream":"stdout"')
    stays_running(sandboxd, ref, HELD_SECS, began)
    response.close()
    idles_out_after(sandboxd, ref, time.monotonic())


def test_file_transfers_keep_the_sandbox_from_idling_out(sandboxd: Sandboxd) -> None:
    ref = sandboxd.create(idle_timeout_secs=IDLE_SECS)["id"]
    made = sandboxd.run(ref, ["sh", "-c", f"head -c {BIG_BYTES} /dev/zero >/tmp/big"])
    assert made["exit_code"] == 0
    chunk = b"u" * 65536
    chunks = int(HELD_SECS / 0.25)

    def slow_body() -> Iterator[bytes]:
        for _ in range(chunks):
            yield chunk
            time.sleep(0.25)

    uploaded: list[int] = []

    def upload() -> None:
        conn = UnixHTTPConnection(sandboxd.socket_path, timeout=WAIT_SECS)
        conn.request("PUT", f"/v1/sandboxes/{ref}/files?path=/tmp/up", body=slow_body(), encode_chunked=True)
        uploaded.append(conn.getresponse().status)
        conn.close()

    began = time.monotonic()
    uploading = threading.Thread(target=upload, daemon=True)
    uploading.start()
    stays_running(sandboxd, ref, HELD_SECS / 2, began)
    download = paused_get(sandboxd, f"/v1/sandboxes/{ref}/files?path=/tmp/big")
    uploading.join(WAIT_SECS)
    assert uploaded == [204]  # the upload took HELD_SECS; the download alone holds the sandbox from here
    stays_running(sandboxd, ref, HELD_SECS / 2, began)
    download.close()
    idles_out_after(sandboxd, ref, time.monotonic())
    # What the upload wrote arrived whole (read from the terminated sandbox's audit, no need to wake it).
    written = [e for e in sandboxd.request("GET", f"/v1/sandboxes/{ref}/events").json()["events"]
               if e["type"] == "file.written" and e["path"] == "/tmp/up"]  # fmt: skip
    assert written and written[-1]["bytes"] == len(chunk) * chunks
