"""A daemon inside a guest that counts, and the helpers that read it (test_snapshots.py, test_persistent.py): its
counter lives in memory and in a file, and it appends a line per tick to another, so a test can tell a sandbox
brought back with its memory (the count goes on) from one booted from its disk (the daemon is gone)."""

from __future__ import annotations

import time

from sandboxd_harness import Response, Sandboxd

# A daemon the API does not track (it outlives the shell that started it): it counts into a file and
# appends one line per tick to another, so memory (the counter) and disk (the lines) can be compared.
COUNTER = (
    "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /sandbox/home/count; echo $i >> /sandbox/home/lines; "
    "sleep 0.02; done' >/dev/null 2>&1 &"
)


def text(server: Sandboxd, ref: str, *argv: str) -> str:
    result = server.run(ref, list(argv))
    assert result["exit_code"] == 0, result
    return str(result["stdout"].decode())


def count(server: Sandboxd, ref: str, timeout_secs: float = 10) -> int:
    """The daemon's counter (0 before it wrote one); a read between its truncate and its write is retried (for a
    running daemon: an empty file that stays empty fails after ``timeout_secs``)."""
    deadline = time.monotonic() + timeout_secs
    while not (
        value := text(server, ref, "sh", "-c", "cat /sandbox/home/count 2>/dev/null || echo 0").strip()
    ):
        assert time.monotonic() < deadline, f"the counter file of {ref} stayed empty: no daemon writes it"
        time.sleep(0.005)
    return int(value)


def wait_count_above(server: Sandboxd, ref: str, above: int, timeout_secs: float = 10) -> int:
    deadline = time.monotonic() + timeout_secs
    while (n := count(server, ref)) <= above:
        assert time.monotonic() < deadline, f"the counter of {ref} stayed at {n}"
        time.sleep(0.05)
    return n


def expect_error(resp: Response, status: int, code: str, words: str) -> None:
    assert resp.status == status, (resp.status, resp.body)
    got_code, message = resp.error
    assert got_code == code and words in message, message
