"""Restart: SIGKILL and SIGTERM of sandboxd keep every sandbox, its processes and their output."""

from __future__ import annotations

import base64
import signal
import time
from collections.abc import Callable
from pathlib import Path

from sandboxd_harness import Sandboxd


def test_sigkill_takes_back_running_sandboxes(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory()
    s = server.create(name="survivor", labels={"k": "v"})
    ref = s["id"]
    server.request("PUT", f"/v1/sandboxes/{ref}/files?path=/sandbox/home/kept", body=b"still here")
    # Counts until told to stop: it runs, printing, however long the restart takes on a loaded machine.
    counter = server.request(
        "POST", f"/v1/sandboxes/{ref}/processes",
        {"argv": ["sh", "-c", "i=0; while [ ! -e /tmp/stop ]; do echo $i; i=$((i+1)); sleep 0.1; done"]},
    ).json()  # fmt: skip
    gone = server.create()
    server.request("DELETE", f"/v1/sandboxes/{gone['id']}")
    time.sleep(0.5)
    server.signal(signal.SIGKILL)
    time.sleep(1.0)  # the counter keeps printing while nobody listens
    server.start()
    listed = {x["id"]: x for x in server.request("GET", "/v1/sandboxes").json()["sandboxes"]}
    assert listed[ref]["state"] == "running" and listed[ref]["name"] == "survivor"
    assert listed[gone["id"]]["state"] == "terminated"
    assert server.run("survivor", ["cat", "/sandbox/home/kept"])["stdout"] == b"still here"
    proc = server.request("GET", f"/v1/sandboxes/{ref}/processes/{counter['pid']}").json()
    assert proc["state"] == "running"
    server.run(ref, ["touch", "/tmp/stop"])
    lines = list(server.follow(ref, counter["pid"]))
    out = b"".join(base64.b64decode(x["data"]) for x in lines if "data" in x)
    # Nothing lost or repeated across the restart (it printed while nobody listened).
    count = out.count(b"\n")
    assert count > 10 and out == b"".join(b"%d\n" % i for i in range(count))
    assert lines[-1] == {"exit_code": 0}
    # A new process gets a new handle, never a reused one.
    again = server.request("POST", f"/v1/sandboxes/{ref}/processes", {"argv": ["true"]}).json()
    assert again["pid"] > counter["pid"]


def test_sigterm_stops_cleanly_and_keeps_sandboxes(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory()
    s = server.create()
    server.signal(signal.SIGTERM)
    assert server.proc is not None and server.proc.returncode == 0
    assert not server.socket_path.exists()
    # runsc's pin of its gofers' network namespace (the platform probe's too) is not left mounted in the state
    # directory (the running sandbox's root is, until it ends); the sandbox lost nothing by it.
    assert [p for p in mounts_under(server.state_dir) if p.endswith("/null-netns")] == []
    server.start()
    assert server.run(s["id"], ["echo", "ok"])["stdout"] == b"ok\n"
    # A sandbox started after the pin was released gets a new one and works.
    fresh = server.create()
    assert server.run(fresh["id"], ["echo", "ok"])["stdout"] == b"ok\n"


def mounts_under(directory: Path) -> list[str]:
    """The mount points under ``directory`` (the kernel's mount table)."""
    prefix = str(directory.resolve()) + "/"
    with open("/proc/self/mountinfo", encoding="utf-8") as table:
        return [p for p in (line.split()[4] for line in table) if p.startswith(prefix)]


def test_second_server_on_same_state_dir_refuses(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory()
    from sandboxd_harness import Sandboxd as Server

    twin = Server(server.workdir, args=[])
    twin.socket_path = server.workdir / "twin.sock"
    twin.log_path = server.workdir / "twin.log"
    twin.start(wait=False)
    assert twin.proc is not None
    assert twin.proc.wait(timeout=30) == 1
    assert "another sandboxd is already using the state directory" in twin.log_text()


def test_restart_finishes_teardowns_a_kill_interrupted(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory()
    s = server.create()
    assert server.request("DELETE", f"/v1/sandboxes/{s['id']}").status == 204
    server.signal(signal.SIGKILL)  # the teardown (about a second) has not finished
    leftovers = server.state_dir / "gvisor" / s["id"]
    server.start()
    deadline = time.monotonic() + 30
    while leftovers.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers.exists()
    mounts = [
        line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines() if s["id"] in line
    ]
    assert mounts == []
    assert server.request("GET", f"/v1/sandboxes/{s['id']}").json()["state"] == "terminated"


def test_process_records_survive_a_kill_with_and_without_output(
    sandboxd_factory: Callable[..., Sandboxd],
) -> None:
    server = sandboxd_factory()
    ref = server.create()["id"]
    quiet = server.request("POST", f"/v1/sandboxes/{ref}/processes", {"argv": ["true"]}).json()["pid"]
    assert server.run(ref, ["echo", "hi"])["stdout"] == b"hi\n"
    assert server.run(ref, ["sh", "-c", "exit 3"])["exit_code"] == 3
    directory = server.state_dir / "sandboxes" / ref / "processes"
    # One journal of records; an output log only for what printed (a file per run cost most of a run's CPU).
    assert (directory / "journal.ndjson").exists() and not (directory / f"{quiet}.out").exists()
    server.signal(signal.SIGKILL)
    server.start()
    listed = server.request("GET", f"/v1/sandboxes/{ref}/processes").json()["processes"]
    assert [(p["pid"], p["argv"][0], p["state"], p["exit_code"]) for p in listed] == [
        (quiet, "true", "exited", 0), (quiet + 1, "echo", "exited", 0), (quiet + 2, "sh", "exited", 3),
    ]  # fmt: skip
    assert list(server.follow(ref, quiet)) == [{"exit_code": 0}]
    echoed = list(server.follow(ref, quiet + 1))
    assert base64.b64decode(echoed[0]["data"]) == b"hi\n" and echoed[-1] == {"exit_code": 0}
    # The agent's side is forgotten (its FORGETs go with later frames) and new handles are new.
    for _ in range(3):
        assert server.run(ref, ["true"])["exit_code"] == 0
    assert server.request("GET", f"/v1/sandboxes/{ref}/processes").json()["processes"][-1]["pid"] == quiet + 5
