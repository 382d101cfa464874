"""Benchmark `sandbox-cli mcp`: what a tool call adds over the SDK, and how long a session's clean-up takes.

    sudo .venv/bin/python bench/bench_mcp.py [--runs 100] [--sandboxes 4] [--rounds 3]

- `run` of `true` through the MCP server (stdio, the `mcp` SDK's client) vs the same run through the Python
  SDK, alternating in one run on one sandbox: p50/p95 of each and what MCP adds;
- a call refused by its schema (nothing sent to the node): the protocol's own round trip;
- `run` of a command writing 8 MiB (the node's limit) both ways: the cost of capping it to 32 KiB;
- the end of a session holding N sandboxes: from the host closing stdin to the server's exit (its clean-up
  terminates the N sandboxes at once), against the 2 s an SDK client waits before SIGTERM.

Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mcp.client.stdio
from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from sandboxd_harness import Sandboxd, missing_requirements

from sbx.client import AsyncClient

CLI = str(Path(sys.executable).parent / "sandbox-cli")
BIG = "head -c 8388608 /dev/zero | tr '\\0' a"


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, in milliseconds."""
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def params(server: Sandboxd) -> StdioServerParameters:
    return StdioServerParameters(command=CLI, args=["--url", f"unix://{server.socket_path}", "mcp", "--log-level",
                                                     "warning"])  # fmt: skip


async def calls(server: Sandboxd, runs: int) -> None:
    async with AsyncClient(f"unix://{server.socket_path}") as sdk, Client(params(server)) as client:
        made = await client.call_tool("create_sandbox", {})
        sid = made.structured_content["id"]  # type: ignore[index]
        sandbox = await sdk.sandboxes.get(sid)
        for label, argv, n in (
            ("run `true`", ["true"], runs),
            ("run writing 8 MiB", ["sh", "-c", BIG], runs // 5),
        ):
            direct: list[float] = []
            through: list[float] = []
            for _ in range(n):
                start = time.perf_counter()
                await sandbox.run(argv)
                direct.append(time.perf_counter() - start)
                start = time.perf_counter()
                result = await client.call_tool("run_command", {"sandbox": sid, "argv": argv})
                through.append(time.perf_counter() - start)
                assert not result.is_error, result.content
            added = statistics.median(through) - statistics.median(direct)
            print(
                f"{label:<20} SDK p50 {pct(direct, 0.5):7.1f} ms p95 {pct(direct, 0.95):7.1f} ms | "
                f"MCP p50 {pct(through, 0.5):7.1f} ms p95 {pct(through, 0.95):7.1f} ms | "
                f"added at p50 {1000 * added:6.1f} ms ({n} calls each)"
            )
        # The protocol's own round trip: a call the MCP server refuses before sending anything to the node.
        floor: list[float] = []
        for _ in range(runs):
            start = time.perf_counter()
            result = await client.call_tool("run_command", {"sandbox": sid})
            floor.append(time.perf_counter() - start)
            assert result.is_error
        print(
            f"{'refused call':<20} MCP p50 {pct(floor, 0.5):7.1f} ms p95 {pct(floor, 0.95):7.1f} ms (no node request)"
        )


async def clean_up(server: Sandboxd, sandboxes: int, rounds: int) -> None:
    # Measure the clean-up itself: a patient host, so that nothing is cut short.
    mcp.client.stdio.PROCESS_TERMINATION_TIMEOUT = 120.0
    for _ in range(rounds):
        async with Client(params(server)) as client:
            for _ in range(sandboxes):
                await client.call_tool("create_sandbox", {})
            start = time.perf_counter()
        secs = time.perf_counter() - start
        print(f"session end with {sandboxes} sandboxes: {secs:.2f} s from closing stdin to the server's exit")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--sandboxes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if (missing := missing_requirements()) is not None:
        sys.exit(missing)
    workdir = Path(tempfile.mkdtemp(prefix="bench-mcp-", dir="/var/tmp"))
    server = Sandboxd(workdir).start()
    try:
        asyncio.run(calls(server, args.runs))
        asyncio.run(clean_up(server, args.sandboxes, args.rounds))
    finally:
        server.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
