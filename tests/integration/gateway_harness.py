"""Start a real ``sandbox-gateway`` in front of real sandboxd nodes, and talk HTTP to it.

A gateway listens on a free loopback port (or a unix socket when given one); its state file, node file and audit
log live in its own temp dir. Every gateway the harness starts is stopped at the end of the test; on failure its
log is kept in test-artifacts/ with the nodes' evidence.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sandboxd_harness import (
    Response,
    Sandboxd,
    UnixHTTPConnection,
    free_port,
    ndjson_lines,
    send,
    stop_process,
)

#: Fast health settings for tests: poll every 0.3 s, unhealthy after 3 failures, lost after 3 s.
FAST_ARGS = [
    "--poll-interval",
    "0.3",
    "--node-lost-after",
    "3s",
    "--forget-interval",
    "1s",
    "--recheck-interval",
    "1s",
]


class GatewayProcess:
    """One running sandbox-gateway."""

    def __init__(
        self, workdir: Path, nodes: list[tuple[str, Sandboxd]], args: list[str] | None = None,
        socket_path: Path | None = None, database: str | None = None, database_env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        """``socket_path``: listen there (a unix socket) instead of on the loopback port. ``database``: keep the
        state in PostgreSQL at that URL (its password in ``database_env``; local files in ``workdir``) instead
        of the SQLite file ``gateway.db``."""
        self.workdir = workdir
        self.database = database
        self.database_env = database_env or {}
        self.socket_path = socket_path
        self.state_path = workdir / "gateway.db"
        self.log_path = workdir / "gateway.log"
        self.node_file = workdir / "nodes.toml"
        self.port = free_port()
        self.args = args or []
        self.proc: subprocess.Popen[bytes] | None = None
        #: Where the last start's lines begin in the log (``log_since_start``).
        self.log_start = 0
        self.node_file.write_text(
            "".join(
                f'[[node]]\nname = "{name}"\nendpoint = "unix://{node.socket_path}"\n\n'
                for name, node in nodes
            )
        )

    def store_args(self) -> list[str]:
        """``--state FILE``, or ``--database URL`` (and ``--data-dir`` for serve: see ``start``)."""
        if self.database is not None:
            return ["--database", self.database]
        return ["--state", str(self.state_path)]

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``sandbox-gateway ARGS`` (offline commands) with this gateway's state."""
        result = subprocess.run(
            [sys.executable, "-m", "sbx.gateway.main", *args, *self.store_args()],
            capture_output=True, text=True, check=False, env={**os.environ, **self.database_env},
        )  # fmt: skip
        if check:
            assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
        return result

    def create_key(self, user: str, *scopes: str, tenant: str | None = None) -> str:
        """A key made offline (the gateway must be stopped); returns its secret."""
        args = ["keys", "create", "--user", user, "--json", *(a for s in scopes for a in ("--scope", s))]
        if tenant:
            args += ["--tenant", tenant]
        return str(json.loads(self.cli(*args).stdout)["secret"])

    def start(self, env: dict[str, str] | None = None) -> GatewayProcess:
        """Serve, with ``env`` added to this process's environment; returns once it answers /v1/health."""
        command = [
            sys.executable, "-m", "sbx.gateway.main", "serve", *self.store_args(),
            *(["--data-dir", str(self.workdir)] if self.database is not None else []),
            "--listen", f"unix:{self.socket_path}" if self.socket_path else f"127.0.0.1:{self.port}",
            "--node-file", str(self.node_file), *self.args,
        ]  # fmt: skip
        self.log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.database_env, **(env or {})})  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            try:
                if self.request("GET", "/v1/health").status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"gateway did not answer:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_since_start(self) -> str:
        """What the process started last has logged. Not the text after its ``sandbox-gateway serving`` line:
        its threads log before that line too (a replica that takes the leader lock at once)."""
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(self.log_start)
            return log.read().decode(errors="replace")

    def connection(self, timeout: float = 120.0) -> http.client.HTTPConnection:
        if self.socket_path is not None:
            return UnixHTTPConnection(self.socket_path, timeout=timeout)
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(
        self, method: str, path: str, json_body: Any = None, *, key: str | None = None,
        headers: dict[str, str] | None = None, body: bytes | None = None, timeout: float = 120.0,
    ) -> Response:  # fmt: skip
        hdrs = dict(headers or {})
        if key is not None:
            hdrs["Authorization"] = f"Bearer {key}"
        return send(self.connection(timeout), method, path, json_body, body, hdrs)

    def create(self, key: str, **fields: Any) -> dict[str, Any]:
        resp = self.request("POST", "/v1/sandboxes", fields, key=key)
        assert resp.status == 201, (resp.status, resp.body)
        return resp.json()  # type: ignore[no-any-return]

    def follow(self, key: str, ref: str, pid: int) -> Iterator[dict[str, Any]]:
        yield from ndjson_lines(self.connection(60), f"/v1/sandboxes/{ref}/processes/{pid}/output",
                                {"Authorization": f"Bearer {key}"})  # fmt: skip

    def stop(self) -> None:
        stop_process(self.proc)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def save_evidence(self, dest: Path) -> None:
        dest.mkdir(parents=True, exist_ok=True)
        if self.log_path.exists():
            shutil.copy(self.log_path, dest / "gateway.log")


def wait_for(predicate: Any, timeout_secs: float = 20.0, interval_secs: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with the last value after the timeout."""
    deadline = time.monotonic() + timeout_secs
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_secs)
    raise AssertionError(f"condition not met within {timeout_secs}s (last: {value!r})")
