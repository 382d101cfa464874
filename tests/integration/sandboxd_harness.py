"""Start a real sandboxd (real gVisor backend) on a temporary socket and state dir, and talk HTTP to it.

Every server the harness starts is stopped, and every sandbox it made is torn down, even when a test fails;
on failure the server log and state files are copied to test-artifacts/<test>/ for a post-mortem.
"""

from __future__ import annotations

import http.client
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DATA_ROOT = Path(os.environ.get("SBX_DATA_ROOT", "/var/lib/sandboxd"))
IMAGES_DIR = DATA_ROOT / "images"
AGENT_PATH = DATA_ROOT / "agent" / "sbx-agent"
#: The runsc every server the harness starts runs, and the tests' own runsc commands: the one scripts/install.sh
#: builds, unless SBX_RUNSC names another (to run the suite against another gVisor build).
RUNSC = os.environ.get("SBX_RUNSC", str(DATA_ROOT / "runsc" / "runsc"))

#: Ports each test process takes from (``free_port``): a block of its own below the kernel's ephemeral range
#: (32768-60999 by default), so parallel workers (pytest-xdist) and outgoing connections never collide.
PORT_BLOCK = 1000
PORT_BASE = 20000
#: Most parallel workers given their own port block and subnet.
MAX_WORKERS = 12


def worker_index() -> int:
    """This test process's pytest-xdist worker number (``gw3``: 3), 0 when not run by xdist, plus
    ``SBX_TEST_WORKER_OFFSET`` (default 0): two test runs at once on one machine (two worktrees) each take their
    own ports and subnets when the second is given an offset past the first's workers."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(name.removeprefix("gw")) if name.removeprefix("gw").isdigit() else 0
    index += int(os.environ.get("SBX_TEST_WORKER_OFFSET", "0") or 0)
    if index >= MAX_WORKERS:
        raise RuntimeError(f"at most {MAX_WORKERS} parallel workers have ports and subnets of their own")
    return index


def worker_ports() -> range:
    """The ports ``free_port`` hands out in this process."""
    start = PORT_BASE + worker_index() * PORT_BLOCK
    return range(start, start + PORT_BLOCK)


def worker_subnet() -> ipaddress.IPv4Network:
    """Where the sandbox subnets of the sandboxd servers this process starts come from (unless a test gives its
    own): one /16 per worker, apart from sandboxd's default 10.200.0.0/16 (a node this machine may run) and from
    the /20s of ``net_world.free_subnet`` (10.64.0.0/10)."""
    return ipaddress.IPv4Network(f"10.{210 + worker_index()}.0.0/16")


_ports = itertools.cycle(worker_ports())
#: Each server its own /20 of the worker's /16 (1,024 sandboxes with a network), in turn: servers running at
#: once (a gateway's nodes) never share addresses.
_subnets = itertools.cycle(worker_subnet().subnets(new_prefix=20))


def with_defaults(config_text: str, section: str, defaults: dict[str, str]) -> str:
    """``config_text`` with each key of ``defaults`` set in ``[section]`` (to the string value) unless it sets
    that key itself: the section is added, or the missing keys go under its header."""
    header = re.search(rf"^\[{re.escape(section)}\][ \t]*$", config_text, re.MULTILINE)
    body = "" if header is None else config_text[header.end() :].split("\n[", 1)[0]
    missing = "".join(
        f"\n{key} = {json.dumps(value)}"
        for key, value in defaults.items()
        if not re.search(rf"^\s*{re.escape(key)}\s*=", body, re.MULTILINE)
    )
    if header is None:
        return f"{config_text}\n[{section}]{missing}\n"
    return f"{config_text[: header.end()]}{missing}{config_text[header.end() :]}"


def missing_requirements() -> str | None:
    """Why integration tests cannot run here, or None when they can."""
    if shutil.which(RUNSC) is None:
        return f"runsc (gVisor) is not installed at {RUNSC}: run scripts/install.sh"
    if os.geteuid() != 0:
        return "integration tests need root (gVisor sandboxes, loop mounts)"
    if not AGENT_PATH.is_file():
        return f"the sandbox agent {AGENT_PATH} is not built: run scripts/install.sh"
    if not any(IMAGES_DIR.glob("*/image.json")):
        return f"no image installed in {IMAGES_DIR}: run scripts/install.sh"
    return None


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a unix socket; Host stays ``localhost``."""

    def __init__(self, path: Path, timeout: float = 120.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(str(self.socket_path))
        self.sock = sock


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error(self) -> tuple[str, str]:
        """(code, message) of an error body."""
        err = self.json()["error"]
        return err["code"], err["message"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for the caller to bind next: the next one of this test
    process's own block (``worker_ports``), so that parallel workers never pick the same one and none is a
    port the kernel hands out as an ephemeral source port meanwhile."""
    for _ in range(PORT_BLOCK):
        port = next(_ports)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # held by something else (another program of this machine): the next
            return port
    raise RuntimeError(f"no free port in {worker_ports()}: every one is taken")


def localhost_certificate(cert: Path, key: Path) -> None:
    """Write a self-signed certificate for localhost and 127.0.0.1 (valid a day) and its key (openssl)."""
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip


def send(
    conn: http.client.HTTPConnection, method: str, path: str, json_body: Any = None, body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> Response:  # fmt: skip
    """One request on ``conn`` (closed after), ``json_body`` sent as JSON when given."""
    hdrs = dict(headers or {})
    if json_body is not None:
        body = json.dumps(json_body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def files_holding(root: Path, needle: str) -> list[str]:
    """Every file under ``root`` holding ``needle`` (GNU grep: recursive, symlinks not followed, sockets and
    FIFOs skipped, the holes of sparse disk images skipped). A file removed while it is searched (a sandbox
    being torn down) is passed over."""
    from sbx.backends.runsc import NULL_NETNS

    found = subprocess.run(
        # runsc's pin of the gofers' empty network namespace (an nsfs bind, unreadable: EINVAL) holds no data.
        ["grep", "-rlF", f"--exclude={NULL_NETNS}", "--", needle, str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    errors = [line for line in found.stderr.splitlines() if not line.endswith(": No such file or directory")]
    assert found.returncode in (0, 1) or (found.returncode == 2 and not errors), found.stderr
    return found.stdout.splitlines()


def ndjson_lines(
    conn: http.client.HTTPConnection, path: str, headers: dict[str, str] | None = None
) -> Iterator[dict[str, Any]]:
    """The events of an ndjson stream (GET ``path`` on ``conn``) as they come; 200 expected."""
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        while line := resp.readline():
            yield json.loads(line)
    finally:
        conn.close()


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 20 s."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Sandboxd:
    """One running sandboxd process."""

    def __init__(self, workdir: Path, config_text: str = "", args: list[str] | None = None) -> None:
        self.workdir = workdir
        self.state_dir = workdir / "state"
        self.socket_path = workdir / "sandboxd.sock"
        self.log_path = workdir / "sandboxd.log"
        self.config_path = workdir / "sandboxd.toml"
        # The harness's paths and a subnet of this worker's, each unless config_text sets it (a benchmark's
        # variant naming another runsc, a test's own subnet).
        paths = {"images_dir": str(IMAGES_DIR), "agent_path": str(AGENT_PATH), "runsc": RUNSC}
        text = with_defaults(
            with_defaults(config_text, "paths", paths), "network", {"subnet": str(next(_subnets))}
        )
        self.config_path.write_text(text, encoding="utf-8")
        self.args = args or []
        #: Bearer token sent with every request, for servers started with --token-file.
        self.token: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        listen_given = any(a.startswith("--listen") for a in self.args)
        socket_args = [] if listen_given else ["--socket", str(self.socket_path)]
        return [
            sys.executable, "-m", "sbx.node.main", *socket_args, "--state-dir", str(self.state_dir),
            "--config", str(self.config_path), *self.args,
        ]  # fmt: skip

    def start(self, wait: bool = True) -> Sandboxd:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_secs: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_secs
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandboxd exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            try:
                if self.request("GET", "/v1/capabilities").status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"sandboxd did not answer within {timeout_secs}s:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def request(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 120.0,
    ) -> Response:
        hdrs = dict(headers or {})
        if self.token is not None:
            hdrs.setdefault("Authorization", f"Bearer {self.token}")
        return send(
            UnixHTTPConnection(self.socket_path, timeout=timeout), method, path, json_body, body, hdrs
        )

    def create(self, **fields: Any) -> dict[str, Any]:
        resp = self.request("POST", "/v1/sandboxes", fields)
        assert resp.status == 201, (resp.status, resp.body)
        return resp.json()  # type: ignore[no-any-return]

    def run(self, ref: str, argv: list[str], **fields: Any) -> dict[str, Any]:
        resp = self.request("POST", f"/v1/sandboxes/{ref}/run", {"argv": argv, **fields})
        assert resp.status == 200, (resp.status, resp.body)
        result = resp.json()
        import base64

        result["stdout"] = base64.b64decode(result["stdout"])
        result["stderr"] = base64.b64decode(result["stderr"])
        return result  # type: ignore[no-any-return]

    def follow(self, ref: str, pid: int) -> Iterator[dict[str, Any]]:
        """Output events of a process as they come (the ndjson stream, read line by line)."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token is not None else None
        yield from ndjson_lines(UnixHTTPConnection(self.socket_path, timeout=60),
                                f"/v1/sandboxes/{ref}/processes/{pid}/output", headers)  # fmt: skip

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        stop_process(self.proc)

    def teardown(self) -> None:
        """Stop the server and destroy everything it left: sandboxes, mounts, cgroups."""
        self.stop()
        runsc_root = self.state_dir / "gvisor" / "runsc"
        if runsc_root.exists():
            listing = subprocess.run(
                [RUNSC, "--root", str(runsc_root), "list", "-quiet"],
                capture_output=True,
                text=True,
                check=False,
            )
            from sbx.backends.freezer import CgroupFreezer

            for sandbox_id in listing.stdout.split():
                # A parked sandbox first: runsc's kill would wait for its thaw for ever.
                CgroupFreezer("/sandboxd").thaw(sandbox_id)
                # A sandbox with a network answers only inside its namespace (docs/network.md).
                netns = Path(f"/var/run/netns/sbx-{sandbox_id}")
                runsc = ["nsenter", f"--net={netns}"] if netns.exists() else []
                runsc += [RUNSC, "--root", str(runsc_root)]
                subprocess.run([*runsc, "kill", sandbox_id, "KILL"], capture_output=True, check=False)
                subprocess.run([*runsc, "delete", "-force", sandbox_id], capture_output=True, check=False)
        # A server killed before its backend closed leaves runsc's network namespace pin mounted (and so its
        # state directory unremovable); a probe's directory too.
        from sbx.backends.runsc import release_roots_under

        release_roots_under(self.state_dir)
        for directory in (self.state_dir / "gvisor").glob("sbx_*"):
            if Path(f"/var/run/netns/sbx-{directory.name}").exists():  # its veth goes with it
                subprocess.run(
                    ["ip", "netns", "del", f"sbx-{directory.name}"], capture_output=True, check=False
                )
        from sbx.net.egress import instance_tag

        # The egress rules of a server that was killed with sandboxes that had a network (none otherwise).
        table = f"sbx_{instance_tag(str(self.state_dir.resolve()))}"
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True, check=False)
        mounts = [
            line.split()[4]
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4].startswith(str(self.workdir))
        ]
        for mount_point in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mount_point], capture_output=True, check=False)
        cgroup_root = Path("/sys/fs/cgroup")
        for controller in cgroup_root.iterdir():
            parent = controller / "sandboxd"
            if parent.is_dir():
                for child in parent.iterdir():
                    if child.is_dir() and child.name.startswith("sbx_") and self._owns(child.name):
                        try:
                            child.rmdir()
                        except OSError:
                            pass

    def _owns(self, sandbox_id: str) -> bool:
        return (self.state_dir / "sandboxes" / sandbox_id).exists() or (
            self.state_dir / "gvisor" / sandbox_id
        ).exists()

    def save_evidence(self, dest: Path) -> None:
        dest.mkdir(parents=True, exist_ok=True)
        if self.log_path.exists():
            shutil.copy(self.log_path, dest / "sandboxd.log")
        for console in self.state_dir.glob("gvisor/*/console.log"):
            shutil.copy(console, dest / f"{console.parent.name}-console.log")
        for record in self.state_dir.glob("sandboxes/*/sandbox.json"):
            shutil.copy(record, dest / f"{record.parent.name}.json")
