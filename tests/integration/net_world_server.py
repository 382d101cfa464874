"""HTTP (port 80) and HTTPS (port 443) servers of the test internet; run inside its network namespace.

Usage: ``python3 net_world_server.py CERT KEY READY_FILE``. Paths:

- ``/who``: the server address the client reached (so a test sees where a connection really went);
- ``/bytes/N``: N bytes (downloads for the benchmark);
- ``/hold``: one byte every 0.1 s until the client goes away (an open connection to cut);
- UDP port 7: echo.
"""

from __future__ import annotations

import socket
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_CHUNK = b"x" * (256 * 1024)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/who":
            body = self.connection.getsockname()[0].encode()
            self._send(body)
        elif self.path.startswith("/bytes/"):
            remaining = int(self.path.removeprefix("/bytes/"))
            self.send_response(200)
            self.send_header("Content-Length", str(remaining))
            self.end_headers()
            while remaining > 0:
                chunk = _CHUNK[: min(remaining, len(_CHUNK))]
                self.wfile.write(chunk)
                remaining -= len(chunk)
        elif self.path == "/hold":
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b".")
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:
                return
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    address_family = socket.AF_INET
    allow_reuse_address = True


def _udp_echo() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 7))
    while True:
        data, peer = sock.recvfrom(2048)
        sock.sendto(data, peer)


def main() -> None:
    cert, key, ready = sys.argv[1:4]
    plain = Server(("0.0.0.0", 80), Handler)
    tls = Server(("0.0.0.0", 443), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    tls.socket = context.wrap_socket(tls.socket, server_side=True)
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    threading.Thread(target=_udp_echo, daemon=True).start()
    Path(ready).write_text("ready")
    tls.serve_forever()


if __name__ == "__main__":
    main()
