"""Benchmark the TypeScript SDK against the Python SDK on the same sandboxd, in one run.

    sudo .venv/bin/python bench/bench_sdk_typescript.py [--runs 100] [--mib 32] [--keys 200]

Needs the SDK built (scripts/install.sh: npm ci and tsc in sdk/typescript). Measures, through each SDK over the
node's unix socket: `run(["true"])` round trips (p50/p95), writing and reading back a file of N MiB (MiB/s),
and the echo of a keystroke on an attached terminal (p50/p95; the TypeScript SDK attaches over the WebSocket
form, the Python SDK over the raw sbx-stream/1 upgrade). Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_sandboxd import bench_node, pct

from sbx.api import frames
from sbx.client import AsyncClient


async def python_side(socket_path: Path, runs: int, mib: int, keys: int) -> dict[str, Any]:
    async with AsyncClient(f"unix://{socket_path}") as client:
        sandbox = await client.sandboxes.create()
        try:
            run = []
            for _ in range(runs):
                t = time.perf_counter()
                await sandbox.run(["true"])
                run.append(time.perf_counter() - t)
            data = b"x" * (mib << 20)
            t = time.perf_counter()
            await sandbox.files.write("/sandbox/home/blob", data)
            write = time.perf_counter() - t
            t = time.perf_counter()
            assert len(await sandbox.files.read("/sandbox/home/blob")) == len(data)
            read = time.perf_counter() - t
            proc = await sandbox.start_process(["cat"], tty=True)
            echo = []
            async with await proc.attach() as attached:
                for _ in range(keys):
                    t = time.perf_counter()
                    await attached.write_stdin(b"k")
                    seen = b""
                    while b"k" not in seen:
                        frame = await attached.recv()
                        assert frame is not None and frame.type == frames.STDOUT
                        seen += frame.payload
                    echo.append(time.perf_counter() - t)
            return {"run": run, "write": write, "read": read, "echo": echo}
        finally:
            await sandbox.delete()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--keys", type=int, default=200)
    args = parser.parse_args()
    if not (REPO / "sdk" / "typescript" / "dist" / "index.js").is_file():
        sys.exit("the TypeScript SDK is not built: run scripts/install.sh")
    with bench_node("sbxbench-ts-") as (server, _):
        out = subprocess.run(
            ["node", str(REPO / "bench" / "sdk_typescript_bench.mjs"), str(server.socket_path), str(args.runs),
             str(args.mib), str(args.keys)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        results = {"TypeScript": json.loads(out.stdout), "Python": asyncio.run(
            python_side(server.socket_path, args.runs, args.mib, args.keys))}  # fmt: skip
    node = subprocess.run(["node", "--version"], capture_output=True, text=True, check=True).stdout.strip()
    print(f"node {node}; {args.runs} runs, {args.mib} MiB file, {args.keys} keys")
    print("| SDK | run p50 / p95 | file write / read | attach echo p50 / p95 |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {pct(r['run'], 50):.1f} / {pct(r['run'], 95):.1f} ms "
            f"| {args.mib / r['write']:.0f} / {args.mib / r['read']:.0f} MiB/s "
            f"| {pct(r['echo'], 50):.2f} / {pct(r['echo'], 95):.2f} ms |"
        )


if __name__ == "__main__":
    main()
