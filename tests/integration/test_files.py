"""Files and directories: PUT/GET/DELETE and dirs, with the path rules."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import pytest
from sandboxd_harness import Sandboxd


def files(ref: str, path: str) -> str:
    from urllib.parse import quote

    return f"/v1/sandboxes/{ref}/files?path={quote(path, safe='')}"


def test_write_read_list_remove(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    ref = sandbox["id"]
    data = os.urandom(3 * 1024 * 1024 + 17)
    assert sandboxd.request("PUT", files(ref, "/sandbox/home/deep/er/blob.bin"), body=data).status == 204
    got = sandboxd.request("GET", files(ref, "/sandbox/home/deep/er/blob.bin"))
    assert got.status == 200 and got.headers["content-type"] == "application/octet-stream"
    assert hashlib.sha256(got.body).digest() == hashlib.sha256(data).digest()
    # The guest sees the same bytes, owned by the sandbox user (parents too).
    digest = sandboxd.run(ref, ["sha256sum", "/sandbox/home/deep/er/blob.bin"])["stdout"].split()[0]
    assert digest.decode() == hashlib.sha256(data).hexdigest()
    # (python, not coreutils stat: runsc before 20231030 rejects the statx flags coreutils passes; backends.md)
    script = "import os; print(os.stat('/sandbox/home/deep').st_uid, os.stat('/sandbox/home/deep/er/blob.bin').st_uid)"
    owners = sandboxd.run(ref, ["python3", "-c", script])
    assert owners["stdout"] == b"1000 1000\n"
    listing = sandboxd.request("GET", f"/v1/sandboxes/{ref}/dirs?path=/sandbox/home/deep/er").json()
    assert listing == {"entries": [{"name": "blob.bin", "type": "file", "size": len(data)}]}
    listing = sandboxd.request("GET", f"/v1/sandboxes/{ref}/dirs?path=/sandbox/home/deep").json()
    assert listing["entries"][0]["name"] == "er" and listing["entries"][0]["type"] == "dir"
    # Overwrite replaces whole.
    assert sandboxd.request("PUT", files(ref, "/sandbox/home/deep/er/blob.bin"), body=b"small").status == 204
    assert sandboxd.request("GET", files(ref, "/sandbox/home/deep/er/blob.bin")).body == b"small"
    # A non-empty directory cannot be removed; a file then the empty directory can.
    resp = sandboxd.request("DELETE", files(ref, "/sandbox/home/deep/er"))
    assert resp.status == 409 and resp.error[0] == "conflict"
    assert sandboxd.request("DELETE", files(ref, "/sandbox/home/deep/er/blob.bin")).status == 204
    assert sandboxd.request("DELETE", files(ref, "/sandbox/home/deep/er")).status == 204
    assert sandboxd.request("GET", files(ref, "/sandbox/home/deep/er/blob.bin")).status == 404
    # Empty files are files too.
    assert sandboxd.request("PUT", files(ref, "/tmp/empty"), body=b"").status == 204
    assert sandboxd.request("GET", files(ref, "/tmp/empty")).body == b""


@pytest.mark.parametrize(
    ("path", "status", "code", "needle"),
    [
        ("relative/file", 400, "invalid_request", "absolute"),
        ("/sandbox/home/../../etc/passwd", 400, "invalid_request", ".."),
        ("/sandbox/home/a\x00b", 400, "invalid_request", "NUL"),
        ("/sandbox/home/missing.txt", 404, "not_found", "/sandbox/home/missing.txt"),
        ("/root/secret", 403, "refused", "permission denied"),
    ],
    ids=["relative", "dotdot", "nul", "absent", "permission"],
)
def test_read_path_rules(sandboxd: Sandboxd, sandbox: dict[str, Any], path: str, status: int, code: str,
                         needle: str) -> None:  # fmt: skip
    resp = sandboxd.request("GET", files(sandbox["id"], path))
    assert resp.status == status, resp.body
    assert resp.error[0] == code and needle in resp.error[1]


def test_missing_path_parameter(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    resp = sandboxd.request("GET", f"/v1/sandboxes/{sandbox['id']}/files")
    assert resp.status == 400 and "path" in resp.error[1]


def test_refused_writes_change_nothing(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    ref = sandbox["id"]
    before = sandboxd.run(ref, ["sha256sum", "/etc/passwd"])["stdout"]
    resp = sandboxd.request("PUT", files(ref, "/etc/passwd"), body=b"root::0:0::/:/bin/sh\n")
    assert resp.status == 403 and resp.error[0] == "refused"
    resp = sandboxd.request("PUT", files(ref, "/etc/../etc/passwd"), body=b"x")
    assert resp.status == 400
    assert sandboxd.run(ref, ["sha256sum", "/etc/passwd"])["stdout"] == before
    resp = sandboxd.request("DELETE", files(ref, "/etc/passwd"))
    assert resp.status == 403
    assert sandboxd.run(ref, ["test", "-f", "/etc/passwd"])["exit_code"] == 0
    # /usr is the image's EROFS (read-only) where nothing in it was the user's to write: refused as before.
    before = sandboxd.run(ref, ["sha256sum", "/usr/bin/env"])["stdout"]
    for method, path in (("PUT", "/usr/bin/env"), ("PUT", "/usr/new"), ("DELETE", "/usr/bin/env")):
        resp = sandboxd.request(method, files(ref, path), body=b"x" if method == "PUT" else None)
        assert (resp.status, resp.error[0]) == (403, "refused"), (method, path, resp.body)
        assert f"permission denied: {path}" in resp.error[1]
    assert sandboxd.run(ref, ["sha256sum", "/usr/bin/env"])["stdout"] == before
    assert sandboxd.run(ref, ["test", "-e", "/usr/new"])["exit_code"] == 1


def test_file_put_over_64_mib_is_413_and_writes_nothing(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    ref = sandbox["id"]
    resp = sandboxd.request("PUT", files(ref, "/tmp/huge"), body=b"\0" * (64 * 1024 * 1024 + 1))
    assert resp.status == 413 and resp.error[0] == "invalid_request"
    assert sandboxd.request("GET", files(ref, "/tmp/huge")).status == 404


def test_disk_limit_is_enforced_inside(sandboxd_factory: Any) -> None:
    server = sandboxd_factory()
    s = server.create(disk_mb=64)
    result = server.run(s["id"], ["sh", "-c", "head -c 100000000 /dev/zero > /sandbox/home/fill; echo $?"])
    assert result["stdout"].strip() != b"0"
    assert b"No space left" in result["stderr"]
    resp = server.request("PUT", files(s["id"], "/sandbox/home/more"), body=b"x" * (2 * 1024 * 1024))
    assert resp.status == 409 and "no space" in resp.error[1]
    # Freeing space makes writes work again.
    assert server.run(s["id"], ["rm", "/sandbox/home/fill"])["exit_code"] == 0
    assert server.request("PUT", files(s["id"], "/sandbox/home/more"), body=b"x" * 1024).status == 204


def test_file_transfers_past_the_cap_are_503_until_one_ends(
    sandboxd: Sandboxd, sandbox: dict[str, Any]
) -> None:
    from sandboxd_harness import UnixHTTPConnection

    from sbx.agent.client import MAX_FILE_TRANSFERS

    ref = sandbox["id"]
    assert sandboxd.run(ref, ["sh", "-c", "head -c 32M /dev/zero > /tmp/big"])["exit_code"] == 0
    held = []
    try:
        for _ in range(MAX_FILE_TRANSFERS):  # each read started and left unread: it holds its transfer
            conn = UnixHTTPConnection(sandboxd.socket_path, timeout=30)
            conn.request("GET", files(ref, "/tmp/big"))
            resp = conn.getresponse()
            assert resp.status == 200
            held.append(conn)
        resp = sandboxd.request("GET", files(ref, "/tmp/empty-or-not"))
        assert resp.status == 503, resp.body
        code, message = resp.error
        assert code == "unavailable" and f"{MAX_FILE_TRANSFERS} file transfers are under way" in message
        assert sandboxd.request("GET", f"/v1/sandboxes/{ref}/dirs?path=/tmp").status == 503
        assert sandboxd.request("PUT", files(ref, "/tmp/new"), body=b"x").status == 503
        assert sandboxd.request("GET", files(ref, "/tmp/new")).status == 503  # nothing was written
    finally:
        for conn in held:
            conn.close()
    deadline = time.monotonic() + 10
    while (resp := sandboxd.request("GET", files(ref, "/tmp/new"))).status == 503:  # the transfers end
        assert time.monotonic() < deadline, resp.body
        time.sleep(0.05)
    assert resp.status == 404
    assert sandboxd.run(ref, ["rm", "/tmp/big"])["exit_code"] == 0
