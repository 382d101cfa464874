"""Run inside a sandbox by the hostile-guest tests: flood a host service for a while, then print what it did.

``python3 hostile_guest.py tcp HOST:PORT SECS``: open TCP connections to HOST:PORT as fast as it can for SECS
seconds, keeping every one that opens (sending nothing). ``python3 hostile_guest.py udp-dns HOST NAME SECS``:
send TXT queries for NAME to HOST:53 as fast as it can for SECS seconds. Both print one JSON line of counts
on stderr at the end. ``python3 hostile_guest.py output SECS FILE``: write to stdout and stderr as fast as it
can for SECS seconds, then write the counts to FILE (its output is what the host may drop).
"""

import json
import os
import socket
import struct
import sys
import time


def flood_tcp(target: str, secs: float) -> dict[str, int]:
    host, port = target.rsplit(":", 1)
    held, counts = [], {"opened": 0, "failed": 0}
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        sock = socket.socket()
        sock.settimeout(1)
        try:
            sock.connect((host, int(port)))
        except OSError:
            counts["failed"] += 1
            sock.close()
            continue
        counts["opened"] += 1
        held.append(sock)
    return counts


def flood_dns(server: str, name: str, secs: float) -> dict[str, int]:
    question = (
        b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\x00" + struct.pack("!HH", 16, 1)
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    counts = {"sent": 0}
    deadline = time.monotonic() + secs
    query_id = 0
    while time.monotonic() < deadline:
        query_id = (query_id + 1) & 0xFFFF
        try:
            sock.sendto(struct.pack("!HHHHHH", query_id, 0x0100, 1, 0, 0, 0) + question, (server, 53))
            counts["sent"] += 1
        except BlockingIOError:
            time.sleep(0.0005)
    return counts


def flood_output(secs: float) -> dict[str, int]:
    chunk = b"x" * 65536
    counts = {"written": 0}
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        counts["written"] += os.write(1, chunk) + os.write(2, chunk[:4096])
    return counts


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "tcp":
        result = flood_tcp(sys.argv[2], float(sys.argv[3]))
    elif kind == "udp-dns":
        result = flood_dns(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    else:
        with open(sys.argv[3], "w") as counts:
            counts.write(json.dumps(flood_output(float(sys.argv[2]))))
        sys.exit(0)
    sys.stderr.write(json.dumps(result) + "\n")
