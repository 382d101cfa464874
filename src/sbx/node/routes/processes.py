"""Processes: run to completion, start in the background, list, follow output, stdin, signal."""

from __future__ import annotations

import base64
import json

from aiohttp import web

from sbx.api.errors import InvalidRequest
from sbx.api.models import decode_object, parse_process, parse_run, parse_signal
from sbx.node.context import NodeContext
from sbx.node.http import FILE_BODY_CAP, json_response, read_json_body, stream_body
from sbx.node.manager import Sandbox
from sbx.node.processes import BASE_ENV


def process_env(sandbox: Sandbox, request_env: dict[str, str]) -> dict[str, str]:
    """The environment a process starts with: base, then the image's (its Env), then the sandbox's, then
    the request's."""
    return {**BASE_ENV, **sandbox.image_env, **sandbox.record.env, **request_env}


def process_cwd(sandbox: Sandbox, body: bytes, parsed_cwd: str) -> str:
    """The request's cwd when it gives one, else the image's WorkingDir, else the parsed default (home)."""
    if sandbox.working_dir is not None and "cwd" not in decode_object(body):
        return sandbox.working_dir
    return parsed_cwd


def parse_pid(request: web.Request) -> int:
    raw = request.match_info["pid"]
    if not raw.isdigit():
        raise InvalidRequest(f"process id {raw!r} must be a positive integer")
    return int(raw)


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    manager = ctx.manager

    async def run(request: web.Request) -> web.Response:
        sandbox = manager.resolve_running(request.match_info["ref"])
        body = await read_json_body(request)
        req = parse_run(body)
        result = await sandbox.processes.run(
            list(req.argv),
            process_env(sandbox, dict(req.env)),
            sorted(req.env),
            process_cwd(sandbox, body, req.cwd),
            req.stdin,
            req.timeout_secs,
        )
        sandbox.touch()
        return json_response(
            {
                "exit_code": result.exit_code,
                "stdout": base64.b64encode(result.stdout).decode(),
                "stderr": base64.b64encode(result.stderr).decode(),
                "truncated": result.truncated,
                "timed_out": result.timed_out,
            }
        )

    async def start(request: web.Request) -> web.Response:
        sandbox = manager.resolve_running(request.match_info["ref"])
        body = await read_json_body(request)
        req = parse_process(body)
        env = process_env(sandbox, dict(req.env))
        tty = (req.rows, req.cols) if req.tty else None
        if tty is not None:
            env.setdefault("TERM", "xterm-256color")
        cwd = process_cwd(sandbox, body, req.cwd)
        proc = await sandbox.processes.start(
            list(req.argv), env, sorted(req.env), cwd, tty=tty, stdin=req.stdin
        )
        return json_response(proc.record.to_wire(), status=201)

    async def list_processes(request: web.Request) -> web.Response:
        sandbox = manager.resolve(request.match_info["ref"])
        return json_response({"processes": [p.to_wire() for p in sandbox.processes.records()]})

    async def get(request: web.Request) -> web.Response:
        sandbox = manager.resolve(request.match_info["ref"])
        return json_response(sandbox.processes.get(parse_pid(request)).record.to_wire())

    async def output(request: web.Request) -> web.StreamResponse:
        sandbox = manager.resolve(request.match_info["ref"])
        pid = parse_pid(request)
        sandbox.processes.get(pid)  # 404 before the stream starts
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        async for event in sandbox.processes.follow(pid):
            if "data" in event:
                event = {"stream": event["stream"], "data": base64.b64encode(event["data"]).decode()}
            await response.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")
        await response.write_eof()
        return response

    async def stdin(request: web.Request) -> web.Response:
        sandbox = manager.resolve_running(request.match_info["ref"])
        pid = parse_pid(request)
        close = request.query.get("close", "0")
        if close not in ("0", "1"):
            raise InvalidRequest("query parameter close must be 0 or 1")
        sandbox.processes.get(pid)
        await sandbox.processes.write_stdin(pid, stream_body(request, FILE_BODY_CAP), close == "1")
        return web.Response(status=204)

    async def signal(request: web.Request) -> web.Response:
        sandbox = manager.resolve_running(request.match_info["ref"])
        pid = parse_pid(request)
        signum = parse_signal(await read_json_body(request))
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
