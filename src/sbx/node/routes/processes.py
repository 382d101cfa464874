"""Processes: run to completion, start in the background, list, follow output, stdin, signal."""

from __future__ import annotations

from aiohttp import web

from sbx.agent.client import AgentConnectionLost
from sbx.api.codec import encode
from sbx.api.errors import Conflict, InvalidRequest
from sbx.api.processes import ProcessList
from sbx.api.requests import parse_process, parse_run, parse_signal
from sbx.node.context import NodeContext
from sbx.node.processes import base_env
from sbx.node.records import SandboxState
from sbx.node.sandbox import Sandbox
from sbx.web.http import FILE_BODY_CAP, json_response, read_json_body, stream_body


def process_env(sandbox: Sandbox, request_env: dict[str, str]) -> dict[str, str]:
    """The environment a process starts with: base, then the image's (its Env), then the sandbox's, then
    the request's."""
    record = sandbox.record
    return {
        **base_env(sandbox.processes.guest),
        **sandbox.image_env,
        **record.env,
        **record.secret_env,
        **request_env,
    }


def process_cwd(sandbox: Sandbox, cwd: str | None) -> str:
    """The request's cwd when it gives one, else the image's WorkingDir, else the sandbox user's home."""
    if cwd is not None:
        return cwd
    return sandbox.working_dir if sandbox.working_dir is not None else sandbox.processes.guest.home


def parse_pid(request: web.Request) -> int:
    raw = request.match_info["pid"]
    if not raw.isdigit():
        raise InvalidRequest(f"process id {raw!r} must be a positive integer")
    return int(raw)


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    manager = ctx.manager

    async def run(request: web.Request) -> web.Response:
        sandbox = manager.resolve_guest(request.match_info["ref"])
        req = parse_run(await read_json_body(request))
        await manager.wake_for_guest(sandbox)
        try:
            result = await sandbox.processes.run(
                list(req.argv),
                process_env(sandbox, dict(req.env)),
                sorted(req.env),
                process_cwd(sandbox, req.cwd),
                req.stdin,
                req.timeout_secs,
            )
        except AgentConnectionLost:
            if sandbox.record.state is SandboxState.RUNNING:
                raise
            # Not a fault of the node: a DELETE or stop ended the sandbox while the command ran.
            raise Conflict(
                f"sandbox {sandbox.record.id} became {sandbox.record.state.value} while the command ran"
            ) from None
        sandbox.touch()
        return json_response(result)

    async def start(request: web.Request) -> web.Response:
        sandbox = manager.resolve_guest(request.match_info["ref"])
        req = parse_process(await read_json_body(request))
        await manager.wake_for_guest(sandbox)
        env = process_env(sandbox, dict(req.env))
        tty = (req.rows, req.cols) if req.tty else None
        if tty is not None:
            env.setdefault("TERM", "xterm-256color")
        cwd = process_cwd(sandbox, req.cwd)
        proc = await sandbox.processes.start(
            list(req.argv), env, sorted(req.env), cwd, tty=tty, stdin=req.stdin
        )
        return json_response(proc.record.wire(), status=201)

    async def list_processes(request: web.Request) -> web.Response:
        sandbox = manager.resolve(request.match_info["ref"])
        return json_response(ProcessList([p.wire() for p in sandbox.processes.records()]))

    async def get(request: web.Request) -> web.Response:
        sandbox = manager.resolve(request.match_info["ref"])
        return json_response(sandbox.processes.get(parse_pid(request)).record.wire())

    async def output(request: web.Request) -> web.StreamResponse:
        sandbox = manager.resolve(request.match_info["ref"])
        pid = parse_pid(request)
        sandbox.processes.get(pid)  # 404 before the stream starts
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        async for event in sandbox.processes.follow(pid):
            await response.write(encode(event) + b"\n")
        await response.write_eof()
        return response

    async def stdin(request: web.Request) -> web.Response:
        sandbox = manager.resolve_guest(request.match_info["ref"])
        pid = parse_pid(request)
        close = request.query.get("close", "0")
        if close not in ("0", "1"):
            raise InvalidRequest("query parameter close must be 0 or 1")
        sandbox.processes.get(pid)
        await manager.wake_for_guest(sandbox)
        await sandbox.processes.write_stdin(pid, stream_body(request, FILE_BODY_CAP), close == "1")
        return web.Response(status=204)

    async def signal(request: web.Request) -> web.Response:
        sandbox = manager.resolve_guest(request.match_info["ref"])
        pid = parse_pid(request)
        signum = parse_signal(await read_json_body(request))
        await manager.wake_for_guest(sandbox)
        await sandbox.processes.signal(pid, signum)
        return web.Response(status=204)

    base = "/v1/sandboxes/{ref}"
    return [
        web.post(f"{base}/run", run),
        web.post(f"{base}/processes", start),
        web.get(f"{base}/processes", list_processes),
        web.get(f"{base}/processes/{{pid}}", get),
        web.get(f"{base}/processes/{{pid}}/output", output),
        web.post(f"{base}/processes/{{pid}}/stdin", stdin),
        web.post(f"{base}/processes/{{pid}}/signal", signal),
    ]
