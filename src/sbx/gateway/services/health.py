"""One health check of one replica, through its node's public API (never a connection of the gateway's own to
the guest):

- ``{http: path}``: ``GET path`` over a tunnel to the replica's ``port`` (``sbx-tunnel/1``); a status of 200 to
  399 passes;
- ``{command: [...]}``: a run of the command in the replica; exit code 0 passes;
- no health check: the replica's command still running passes.

Each answers None when the check passed, else what failed (a short text for ``last_error``, never output).
:func:`check` says besides whether the failure is final: the command exited, or the sandbox is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from msgspec import UNSET

from sbx.api.errors import InvalidRequest, NotFound, SandboxError
from sbx.api.processes import RunRequest
from sbx.api.services import HealthCheck
from sbx.gateway.nodeclient import NodeClient, Refusal
from sbx.web.upgrade import parse_head

#: Bytes of an answer's head parsed at most (the tunnel's reader bounds what is read).
MAX_HEAD_BYTES = 64 * 1024


async def check_http(
    client: NodeClient, sandbox: str, port: int, path: str, timeout_secs: float
) -> str | None:
    """``GET path`` on the guest's ``127.0.0.1:port``; None when it answered 200 to 399."""
    try:
        async with asyncio.timeout(timeout_secs):
            opened = await client.open_tunnel(sandbox, port)
            if isinstance(opened, Refusal):
                return f"the node refused the tunnel to port {port} ({opened.reason()})"
            reader, writer = opened
            try:
                writer.write(
                    f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: sbx-gateway-health\r\n"
                    "Connection: close\r\n\r\n".encode("latin-1")
                )
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
            finally:
                writer.close()
    except TimeoutError:
        return f"GET {path} on port {port} did not answer within {timeout_secs:g} s"
    except asyncio.IncompleteReadError:
        return f"nothing answered on port {port} (connection closed)"
    except (OSError, asyncio.LimitOverrunError) as exc:
        return f"GET {path} on port {port} failed: {type(exc).__name__}"
    except SandboxError as exc:
        return exc.message
    try:
        status, _ = parse_head(head[:MAX_HEAD_BYTES])
    except SandboxError:
        return f"port {port} did not answer with HTTP"
    if 200 <= status < 400:
        return None
    return f"GET {path} answered HTTP {status}"


async def check_command(client: NodeClient, sandbox: str, argv: list[str], timeout_secs: float) -> str | None:
    """A run of ``argv``; None when it exited 0 within ``timeout_secs``."""
    try:
        result = await client.run(
            sandbox, RunRequest(argv=argv, timeout_secs=timeout_secs), timeout_secs + 10
        )
    except InvalidRequest as exc:
        return exc.message  # e.g. the program does not exist
    except SandboxError as exc:
        return exc.message
    if result.timed_out:
        return f"the health command did not finish within {timeout_secs:g} s"
    if result.exit_code != 0:
        return f"the health command exited with code {result.exit_code}"
    return None


@dataclass(frozen=True)
class Outcome:
    """A check's result: ``problem`` None when it passed; ``final`` when the replica cannot recover (its command
    exited, its sandbox is gone)."""

    problem: str | None = None
    final: bool = False


PASSED = Outcome()


async def check_process(client: NodeClient, sandbox: str, pid: int) -> Outcome:
    """Passed while process ``pid`` runs; final once it exited or the sandbox is gone."""
    try:
        process = await client.process(sandbox, pid)
    except NotFound:
        return Outcome("the replica's sandbox or command no longer exists", final=True)
    except SandboxError as exc:
        return Outcome(exc.message)
    if process.state == "running":
        return PASSED
    return Outcome(f"the command exited with code {process.exit_code}", final=True)


async def check(client: NodeClient, sandbox: str, pid: int, port: int | None,
                health: HealthCheck | None) -> Outcome:  # fmt: skip
    """The replica's check (see the module docstring). A failed check also asks whether the command still runs, so
    a command that exited is reported as such, and as final."""
    if health is None:
        return await check_process(client, sandbox, pid)
    timeout = float(health.timeout_secs) if health.timeout_secs is not UNSET else 5.0
    if health.http is not UNSET and port is not None:
        problem = await check_http(client, sandbox, port, health.http, timeout)
    elif health.command is not UNSET:
        problem = await check_command(client, sandbox, health.command, timeout)
    else:
        return await check_process(client, sandbox, pid)
    if problem is None:
        return PASSED
    with contextlib.suppress(SandboxError):
        process = await check_process(client, sandbox, pid)
        if process.final:
            return process
    return Outcome(problem)
