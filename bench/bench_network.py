"""Benchmark egress through the allowlist proxy: HTTPS download throughput and added latency, same run.

    sudo .venv/bin/python bench/bench_network.py [--mib 256] [--runs 3] [--requests 50]

Builds the test internet of tests/integration/net_world.py (an HTTPS server in a network namespace, a DNS zone),
starts a sandboxd whose sandboxes resolve through that zone, and measures with the same Python client:

- throughput: an HTTPS download of MIB MiB from ``allowed.test``, best of RUNS, (a) on the host straight to the
  server; (b) by a native (host kernel) client in an ``allowlist`` sandbox's network namespace, through its
  veth, nftables and our proxy: the cost of the enforcement path alone (the sandbox is suspended meanwhile, so
  gVisor's network stack does not answer on the interface, and the client gets its address back, as a restore
  does); (c) inside the running sandbox (gVisor's network stack, ptrace platform, plus the same path); (d) as
  (c) over plain HTTP, to tell TLS in the guest from the network path;
- latency: REQUESTS sequential HTTPS requests (``GET /who``, a new connection each: connect, TLS handshake,
  response) in the same three places; p50 and what (b) and (c) add to (a).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_sandboxd import cpu_secs
from net_world import World
from sandboxd_harness import Sandboxd

CLIENT = r"""
import json, socket, ssl, sys, time
args = json.loads(sys.argv[1])
context = ssl.create_default_context(cadata=args["ca"])

def get(path, sink=False):
    addr = socket.getaddrinfo(args["host"], 443, socket.AF_INET)[0][4][0]
    sock = context.wrap_socket(socket.create_connection((addr, 443)), server_hostname=args["host"])
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {args['host']}\r\nConnection: close\r\n\r\n".encode())
    total = 0
    buf = bytearray(1 << 20)
    while True:
        n = sock.recv_into(buf)
        if not n:
            break
        total += n
    sock.close()
    return total

if args["op"] == "download":
    start = time.monotonic()
    got = get(f"/bytes/{args['bytes']}")
    secs = time.monotonic() - start
    assert got >= args["bytes"], got
    print(json.dumps({"secs": secs}))
else:
    times = []
    for _ in range(args["requests"]):
        start = time.monotonic()
        get("/who")
        times.append(time.monotonic() - start)
    print(json.dumps({"times": times}))
"""


#: The same client over plain HTTP (port 80): what the sandbox's network path moves without TLS.
PLAIN_CLIENT = CLIENT.replace(
    'context.wrap_socket(socket.create_connection((addr, 443)), server_hostname=args["host"])',
    "socket.create_connection((addr, 80))",
)


def p50_ms(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] * 1000


def on_host(args: dict[str, object], netns: str | None = None) -> dict[str, object]:
    """The client run by the host's kernel (in ``netns`` when given); it dials the address directly (the test
    zone is not the host's resolver)."""
    code = CLIENT.replace('socket.getaddrinfo(args["host"], 443, socket.AF_INET)[0][4][0]', 'args["addr"]')
    prefix = ["ip", "netns", "exec", netns] if netns else []
    out = subprocess.run(
        [*prefix, sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def borrow_namespace(node: Sandboxd, sandbox_id: str) -> str:
    """Suspend the sandbox and give its namespace's interface the sandbox's address and route again."""
    resp = node.request("POST", f"/v1/sandboxes/{sandbox_id}/suspend")
    assert resp.status == 200, resp.body
    slot = json.loads((node.state_dir / "gvisor" / sandbox_id / "network.json").read_text())["slot"]
    subnet = next(
        line.split('"')[1] for line in node.config_path.read_text().splitlines() if line.startswith("subnet")
    )
    base = ipaddress.ip_network(subnet).network_address + 4 * slot
    netns = f"sbx-{sandbox_id}"
    subprocess.run(["ip", "-n", netns, "addr", "replace", f"{base + 2}/30", "dev", "eth0"], check=True)
    subprocess.run(["ip", "-n", netns, "route", "replace", "default", "via", str(base + 1)], check=True)
    return netns


def in_sandbox(
    node: Sandboxd, sandbox_id: str, args: dict[str, object], client: str = CLIENT
) -> dict[str, object]:
    result = node.run(sandbox_id, ["python3", "-c", client, json.dumps(args)], timeout_secs=600)
    assert result["exit_code"] == 0, result["stderr"][-2000:]
    return json.loads(result["stdout"])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=50)
    options = parser.parse_args()

    from test_network_egress import _delete_all, _free_subnet, _remove_network_leftovers

    world = World().start()
    workdir = Path(tempfile.mkdtemp(prefix="sbxd-bench-net-", dir="/var/tmp"))
    config = (
        '[network]\nceiling = "open"\ndefault = {mode = "none"}\nmay_allow = ["*"]\n'
        f'subnet = "{_free_subnet()}"\nupstream_dns = ["127.0.0.1:{world.dns_port}"]\n'
        "[limits]\nmax_memory_mb = 4096\n"
    )
    node = Sandboxd(workdir, config)
    try:
        node.start()
        box = node.create(network={"mode": "allowlist", "allow": ["allowed.test"]}, cpus=2)["id"]
        size = options.mib * 1024 * 1024
        common = {"host": "allowed.test", "addr": "198.51.100.10", "ca": world.ca_pem}
        download = {**common, "op": "download", "bytes": size}
        latency = {**common, "op": "latency", "requests": options.requests}
        # Host runs are interleaved with the others (the machine is shared, load changes over a run); (a) is
        # the best of all of them, so the shares below are conservative.
        secs: dict[str, list[float]] = {"host1": [], "sandbox": [], "plain": [], "host2": [], "netns": []}
        for _ in range(options.runs):
            secs["host1"].append(float(on_host(download)["secs"]))  # type: ignore[arg-type]
            secs["sandbox"].append(float(in_sandbox(node, box, download)["secs"]))  # type: ignore[arg-type]
            plain = in_sandbox(node, box, download, PLAIN_CLIENT)
            secs["plain"].append(float(plain["secs"]))  # type: ignore[arg-type]
        times = {"host": on_host(latency)["times"], "sandbox": in_sandbox(node, box, latency)["times"]}
        netns = borrow_namespace(node, box)
        proxy_cpu = 0.0
        for _ in range(options.runs):
            secs["host2"].append(float(on_host(download)["secs"]))  # type: ignore[arg-type]
            before = cpu_secs(node.proc.pid)  # type: ignore[union-attr]
            secs["netns"].append(float(on_host(download, netns)["secs"]))  # type: ignore[arg-type]
            proxy_cpu += cpu_secs(node.proc.pid) - before  # type: ignore[union-attr]
        times["netns"] = on_host(latency, netns)["times"]
        rates = {k: options.mib / min(v) for k, v in secs.items()}
        rate = {
            "host": max(rates["host1"], rates["host2"]),
            "netns": rates["netns"],
            "sandbox": rates["sandbox"],
            "plain": rates["plain"],
        }
        p50 = {k: p50_ms(v) for k, v in times.items()}  # type: ignore[arg-type]
        labels = {
            "host": "(a) host, direct",
            "netns": "(b) native client, sandbox path",
            "sandbox": "(c) in the gVisor sandbox",
            "plain": "(d) as (c), plain HTTP (no TLS)",
        }
        print(f"HTTPS download of {options.mib} MiB, best of {options.runs}:")
        for key in ("host", "netns", "sandbox", "plain"):
            share = f"   {100 * rate[key] / rate['host']:4.0f}% of (a)" if key != "host" else ""
            print(f"  {labels[key]:<34} {rate[key]:8.1f} MiB/s{share}")
        cpu_per_gib = proxy_cpu / (options.runs * options.mib / 1024)
        print(f"  sandboxd (proxy) CPU time during (b): {cpu_per_gib:.2f} s per GiB relayed")
        print(
            f"HTTPS request on a new connection (connect, TLS, response), {options.requests} sequential, p50:"
        )
        for key in ("host", "netns", "sandbox"):
            added = f"   +{p50[key] - p50['host']:.2f} ms" if key != "host" else ""
            print(f"  {labels[key]:<34} {p50[key]:8.2f} ms{added}")
    finally:
        _delete_all(node)
        node.teardown()
        _remove_network_leftovers(node)
        world.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
