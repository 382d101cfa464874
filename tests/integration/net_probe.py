"""Run inside a sandbox (``python3 -c <this file's text> '<json>'``): one network probe, one JSON line out.

Probes (``op``):

- ``http``: connect to ``addr`` (default: ``host`` resolved by the sandbox's resolver) port ``port``, TLS with
  SNI ``sni`` (default ``host``) when ``tls``, verifying against ``ca`` (PEM); GET ``path`` with Host ``host``.
  ``delay``: seconds to wait between connecting and sending. Out: ``{ok, status, body}`` or
  ``{ok: false, error, secs}``.
- ``dns``: one query (``name``, ``qtype`` number; over TCP when ``tcp``) to the resolv.conf server (or
  ``server``): ``{rcode, answers}``.
- ``hold``: like http to ``/hold``, then reads until the connection ends: ``{ok: false, error, read, secs}``.
- ``tcp``: a plain connect to ``addr``:``port``, then a read: ``{ok, error?, secs}``.
- ``udp``: send a datagram to ``addr``:``port`` and wait for an answer: ``{ok, error?}``.
"""

import json
import random
import socket
import ssl
import struct
import sys
import time


def out(**fields):
    print(json.dumps(fields), flush=True)


def connect(args):
    host = args.get("host")
    addr = args.get("addr") or socket.getaddrinfo(host, args["port"], socket.AF_INET)[0][4][0]
    sock = socket.create_connection((addr, args["port"]), timeout=args.get("timeout", 10))
    if args.get("tls"):
        context = ssl.create_default_context(cadata=args["ca"])
        sock = context.wrap_socket(sock, server_hostname=args.get("sni") or host)
    return sock


def request(sock, args):
    time.sleep(args.get("delay", 0))  # a client that speaks late (after the proxy's first-bytes wait)
    path = args.get("path", "/who")
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {args['host']}\r\nConnection: close\r\n\r\n".encode())


def http(args):
    start = time.monotonic()
    try:
        sock = connect(args)
        request(sock, args)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1]) if head else 0
        out(
            ok=status == 200,
            status=status,
            body=body[:200].decode(errors="replace"),
            secs=round(time.monotonic() - start, 3),
        )
    except Exception as exc:  # noqa: BLE001 - the probe reports any failure
        out(ok=False, error=repr(exc), secs=round(time.monotonic() - start, 3))


def hold(args):
    start = time.monotonic()
    read = 0
    try:
        sock = connect(args)
        request(sock, dict(args, path="/hold"))
        sock.settimeout(30)
        print("holding", flush=True)
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                out(ok=False, error="closed", read=read, secs=round(time.monotonic() - start, 3))
                return
            read += len(chunk)
    except Exception as exc:  # noqa: BLE001
        out(ok=False, error=repr(exc), read=read, secs=round(time.monotonic() - start, 3))


def dns(args):
    server = "127.0.0.1"
    with open("/etc/resolv.conf") as resolv:
        for line in resolv:
            parts = line.split()
            if parts[:1] == ["nameserver"]:
                server = parts[1]
                break
    ident = random.randrange(65536)
    qname = b"".join(bytes([len(p)]) + p.encode() for p in args["name"].split(".")) + b"\0"
    packet = struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + qname + struct.pack("!HH", args["qtype"], 1)
    try:
        if args.get("tcp"):
            sock = socket.create_connection((args.get("server", server), 53), timeout=args.get("timeout", 5))
            sock.sendall(struct.pack("!H", len(packet)) + packet)
            length = struct.unpack("!H", sock.recv(2))[0]
            answer = b""
            while len(answer) < length:
                answer += sock.recv(length - len(answer))
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.settimeout(args.get("timeout", 5))
            sock.sendto(packet, (args.get("server", server), 53))
            answer = sock.recv(4096)
    except Exception as exc:  # noqa: BLE001
        out(error=repr(exc))
        return
    _, flags, _, ancount, _, _ = struct.unpack("!HHHHHH", answer[:12])
    out(rcode=flags & 0xF, answers=ancount)


def tcp(args):
    start = time.monotonic()
    try:
        sock = socket.create_connection((args["addr"], args["port"]), timeout=args.get("timeout", 10))
        sock.settimeout(args.get("timeout", 10))
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
        data = sock.recv(100)
        out(ok=bool(data), error="closed" if not data else None, secs=round(time.monotonic() - start, 3))
    except Exception as exc:  # noqa: BLE001
        out(ok=False, error=repr(exc), secs=round(time.monotonic() - start, 3))


def udp(args):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(args.get("timeout", 2))
    try:
        sock.sendto(b"ping", (args["addr"], args["port"]))
        sock.recv(100)
        out(ok=True)
    except Exception as exc:  # noqa: BLE001
        out(ok=False, error=repr(exc))


if __name__ == "__main__":
    probe = json.loads(sys.argv[1])
    {"http": http, "hold": hold, "dns": dns, "tcp": tcp, "udp": udp}[probe["op"]](probe)
