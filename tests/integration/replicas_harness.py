"""Helpers of the gateway replicas' tests (test_gateway_replicas.py, test_gateway_failover.py): a service whose
replicas say which one answered, its traffic through one gateway replica, its view as one replica shows it, and
traffic kept up on a thread while a test does something to the replicas."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Self

from gateway_harness import GatewayProcess

#: The replicas' --services-domain (a service is reached at <label>.DOMAIN by the Host header).
DOMAIN = "svc.test"
_SERVE_ID_SOURCE = (
    "import http.server as h, os\n"
    "t = os.urandom(6).hex().encode()\n"
    "class H(h.BaseHTTPRequestHandler):\n"
    "    protocol_version = 'HTTP/1.1'\n"
    "    def do_GET(s):\n"
    "        s.send_response(200); s.send_header('Content-Length', str(len(t))); s.end_headers()\n"
    "        s.wfile.write(t)\n"
    "    def log_message(s, *a): pass\n"
    "h.ThreadingHTTPServer(('', 8080), H).serve_forever()\n"
)
#: A service's replica on port 8080 that answers every GET with a token of its own (which replica answered).
SERVE_ID = ["python3", "-c", _SERVE_ID_SOURCE]
#: Health checks every second, unhealthy after two failures (a replica gone is unhealthy at its next check).
FAST_HEALTH = {"http": "/", "every_secs": 1, "failures": 2}


def traffic(gw: GatewayProcess, key: str, label: str, by_host: bool = False) -> tuple[int, str]:
    """One request of service ``label`` through ``gw`` (by path, or by Host): (status, body)."""
    if by_host:
        resp = gw.request("GET", "/", key=key, headers={"Host": f"{label}.{DOMAIN}"}, timeout=60)
    else:
        resp = gw.request("GET", f"/svc/{label}/", key=key, timeout=60)
    return resp.status, resp.body.decode(errors="replace")


def shown(gw: GatewayProcess, key: str, name: str) -> tuple[int, list[tuple[str, str, str, bool]]]:
    """A service's ``ready`` and its replicas (sandbox, node, state, healthy) as ``gw`` shows them."""
    got = gw.request("GET", f"/v1/services/{name}", key=key).json()
    reps = sorted((r["sandbox"], r["node"], r["state"], r["healthy"]) for r in got["replicas"])
    return got["ready"], reps


class Load:
    """Requests of one service through one gateway replica, back to back on a thread, until stopped: every answer
    kept with its time (monotonic), so a test can say whether and when traffic failed."""

    def __init__(self, gw: GatewayProcess, key: str, label: str, pause_secs: float = 0.02) -> None:
        self.gw, self.key, self.label, self.pause_secs = gw, key, label, pause_secs
        self.answers: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status, body = traffic(self.gw, self.key, self.label)
            except OSError as exc:  # a failure, as a client would count it
                status, body = 0, type(exc).__name__
            self.answers.append((time.monotonic(), status, body))
            time.sleep(self.pause_secs)

    def failures(self) -> list[tuple[float, int, str]]:
        return [a for a in self.answers if a[1] != 200]

    def longest_gap(self) -> float:
        """The longest time between two successful answers (seconds)."""
        return self.gap_at()[0]

    def gap_at(self) -> tuple[float, float]:
        """The longest time between two successful answers, and when it began (monotonic seconds)."""
        times = [a[0] for a in self.answers if a[1] == 200]
        return max(((b - a, a) for a, b in itertools.pairwise(times)), default=(0.0, 0.0))
