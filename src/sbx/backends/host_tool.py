"""Running a host tool (mkfs, e2fsck, ip, runsc ...) from the backends: its output, or its error as a BackendError."""

from __future__ import annotations

import asyncio

from sbx.backends.base import BackendError


async def run_tool(*argv: str) -> str:
    """Run a host tool, returning its stdout; raise BackendError with its stderr when it fails."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        detail = err.decode(errors="replace").strip() or out.decode(errors="replace").strip()
        raise BackendError(f"{argv[0]} failed (exit {proc.returncode}): {detail}")
    return out.decode(errors="replace")
