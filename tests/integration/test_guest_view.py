"""What ordinary programs see inside a sandbox: a file system coreutils and friends use without an error line,
the sandbox's own CPU count and disk size, the runtime GET /v1/node reports, and the default image's tools
doing real work offline (docs/backends.md, docs/images.md)."""

from __future__ import annotations

import re
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sandboxd_harness
from sandboxd_harness import RUNSC, Sandboxd

from sbx.backends.root_overlay import filestore_bytes
from sbx.backends.runsc import STATX_FIXED_RELEASE, dentry_cache_size, inspect_runsc

# Run by the sandbox user in its home: everything a developer does to files, each must print nothing on
# stderr. (Permission errors a real Linux also gives, like listing /root as a user, are left out.)
FILE_SYSTEM_SCRIPT = r"""
set -eu
cd /sandbox/home && mkdir work && cd work
echo hello > f; ln -s f sl; ln f hl; mkdir d; echo x > d/y; ln -s /etc/passwd abs; ln -s missing dangling
chmod 640 f; chmod 750 d; chmod u+x d/y
ls -l / > /dev/null; ls -la / > /dev/null; ls -l > /dev/null; ls -la /sandbox/home > /dev/null
ls -lR /usr/bin /usr/lib/python3 /etc/apt > /dev/null
stat / /bin /usr/bin/python3 f sl hl d > /dev/null; stat -L sl > /dev/null; stat -f / > /dev/null
du -s /usr > /dev/null; du -sh . > /dev/null
df / /tmp > /dev/null
find /usr /etc/alternatives -xdev > /dev/null; find . -type l > /dev/null
cp -a . ../copy; tar -cf ../t.tar .; mkdir ../untar; tar -xf ../t.tar -C ../untar
test "$(readlink sl)" = f; test "$(readlink -f sl)" = /sandbox/home/work/f
test "$(stat -c %h f)" = 2; test "$(stat -c %a f)" = 640; test "$(stat -c %a d)" = 750
test "$(cat ../copy/sl ../untar/hl)" = "hello
hello"
test "$(readlink ../copy/abs)" = /etc/passwd; test -L ../untar/dangling
touch -d 2020-01-01 f; test "$(stat -c %Y f)" = 1577836800
mv f g; mv g f; rm -rf ../copy ../untar ../t.tar
echo ok
"""


def test_file_system_tools_print_no_errors(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    version = sandboxd.request("GET", "/v1/node").json()["runtime"]["runsc_version"]
    release = int(m.group(1)) if (m := re.search(r"(20\d{6})", version)) else 0
    if 0 < release < STATX_FIXED_RELEASE:
        pytest.skip(
            f"runsc {version} fails statx for coreutils; scripts/install.sh installs a release that does not"
        )
    result = sandboxd.run(sandbox["id"], ["bash", "-c", FILE_SYSTEM_SCRIPT])
    assert (result["exit_code"], result["stderr"], result["stdout"]) == (0, b"", b"ok\n")


def test_extended_attributes_answer_not_supported(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    """Every xattr call answers EOPNOTSUPP, on the root (gofer) and on tmpfs alike (docs/backends.md)."""
    script = (
        "import errno, os\n"
        "open('/tmp/x', 'w').close()\n"
        "for call in (lambda: os.getxattr('/bin', 'security.selinux', follow_symlinks=False),\n"
        "             lambda: os.getxattr('/root', 'user.a'), lambda: os.listxattr('/etc'),\n"
        "             lambda: os.setxattr('/tmp/x', 'user.a', b'1'), lambda: os.removexattr('/tmp/x', 'user.a')):\n"
        "    try:\n"
        "        call(); print('ok')\n"
        "    except OSError as e:\n"
        "        print('EOPNOTSUPP' if e.errno == errno.EOPNOTSUPP else errno.errorcode[e.errno])\n"
    )
    result = sandboxd.run(sandbox["id"], ["python3", "-c", script])
    assert result["stdout"].split() == [b"EOPNOTSUPP"] * 5, result


@pytest.mark.parametrize(("cpus", "seen"), [(1, 2), (2, 2)])
def test_cpus_seen_by_the_guest(sandboxd: Sandboxd, cpus: int, seen: int) -> None:
    """``cpus`` 2 or more is what nproc and /proc/cpuinfo show; runsc shows at least 2 (docs/backends.md)."""
    created = sandboxd.create(cpus=cpus)
    try:
        out = sandboxd.run(created["id"], ["sh", "-c", "nproc; grep -c ^processor /proc/cpuinfo"])["stdout"]
        assert out.split() == [str(seen).encode()] * 2
    finally:
        sandboxd.request("DELETE", f"/v1/sandboxes/{created['id']}")


def test_df_shows_the_sandbox_disk_and_writes_stay_in_it(sandboxd: Sandboxd) -> None:
    created = sandboxd.create(disk_mb=300, memory_mb=256)
    ref = created["id"]
    try:
        sizes = sandboxd.run(ref, ["df", "-B1M", "--output=size,used", "/", "/tmp", "/dev/shm"])
        rows = [line.split() for line in sizes["stdout"].decode().splitlines()[1:]]
        root, tmp, shm = ([int(v) for v in row] for row in rows)
        assert 280 <= root[0] <= 300, rows  # ext4 of 300 MiB less its metadata
        assert tmp[0] == shm[0] == 128, rows  # half of memory_mb each
        # 50 MiB written by the guest are used on that disk, and held in the sandbox's layer directory: in the
        # file store the sentry holds open there for gVisor's overlay sized to the disk (the default with the
        # runsc scripts/install.sh builds, test_root_overlay.py), else in the ext4 layer; never in runsc's
        # unsized root:self store of older releases.
        wrote = sandboxd.run(
            ref, ["sh", "-c", "head -c 52428800 /dev/urandom > big && sync && df -B1M --output=used /"]
        )
        assert int(wrote["stdout"].split()[-1]) >= root[1] + 50
        layer = sandboxd.state_dir / "gvisor" / ref / "layer"
        assert not list(layer.rglob(".gvisor.filestore*"))
        in_overlay = (sandboxd.state_dir / "gvisor" / ref / "bundle" / "root-overlay.json").exists()
        assert in_overlay is inspect_runsc(RUNSC).overlay_tar_streams
        if in_overlay:
            pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
            assert filestore_bytes(pids, layer) >= 52428800
        else:
            assert (layer / "disk" / "upper" / "sandbox" / "home" / "big").stat().st_size == 52428800
        # Past the disk: ENOSPC inside, the host's disk untouched.
        full = sandboxd.run(ref, ["sh", "-c", "head -c 400000000 /dev/zero > more; echo $?"])
        assert full["stdout"].strip() != b"0" and b"No space left on device" in full["stderr"]
        # A full /tmp answers ENOSPC too, and the sandbox lives on.
        tmp_full = sandboxd.run(ref, ["sh", "-c", "head -c 200000000 /dev/zero > /tmp/f; echo $?"])
        assert b"No space left on device" in tmp_full["stderr"]
        assert sandboxd.run(ref, ["true"])["exit_code"] == 0
    finally:
        sandboxd.request("DELETE", f"/v1/sandboxes/{ref}")


def test_node_reports_the_runtime(sandboxd: Sandboxd) -> None:
    runtime = sandboxd.request("GET", "/v1/node").json()["runtime"]
    assert runtime["runsc_version"] and runtime["runsc_path"].endswith("runsc")
    assert runtime["platform"] in ("systrap", "ptrace")
    assert runtime["platform_reason"] == "probed" or runtime["platform"] == "ptrace"
    assert any("extended attributes" in line for line in runtime["limitations"])


def _sandbox_platform(sandbox_id: str) -> str:
    """The platform of the running ``runsc boot`` of ``sandbox_id``, from its --platform flag in /proc (runsc
    passes the flag on only when it is not its default, the first platform its help lists)."""
    return _boot_flag(sandbox_id, "platform") or inspect_runsc(RUNSC).platforms[0]


def _boot_flag(sandbox_id: str, flag: str) -> str | None:
    """The value of ``--flag=`` on the running ``runsc boot`` of ``sandbox_id``, None when it is absent."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "boot" in argv and sandbox_id in argv:
            return next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{flag}=")), None)
    raise AssertionError(f"no runsc boot process for {sandbox_id}")


def test_dentry_cache_is_sized_from_the_open_file_limit(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    """With ``[gvisor] dentry_cache`` 0 every sandbox gets a cache sized from the descriptors its sentry may
    open (docs/config.md): a walk of all of /usr, twice, and reading a few thousand files neither runs the
    sentry out of descriptors ("Too many open files", what a cache too large for the limit did) nor errs."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # sandboxd, and so each sentry, inherits it
    assert _boot_flag(sandbox["id"], "dcache") == str(dentry_cache_size(0, limit))
    script = (
        "set -e; a=$(find /usr -type f | wc -l); b=$(find /usr -type f | wc -l); test $a = $b; "
        "cat /usr/lib/python3.11/*.py /usr/include/*.h > /dev/null; ls -lR /usr/share > /dev/null; echo $a"
    )
    result = sandboxd.run(sandbox["id"], ["sh", "-c", script])
    assert (result["exit_code"], result["stderr"]) == (0, b""), result
    assert int(result["stdout"]) > 20000


def test_dentry_cache_from_the_config(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory("[gvisor]\ndentry_cache = 2500\n")
    created = server.create()
    assert _boot_flag(created["id"], "dcache") == "2500"
    assert server.run(created["id"], ["true"])["exit_code"] == 0


def test_platform_from_the_config(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory('[gvisor]\nplatform = "ptrace"\n')
    runtime = server.request("GET", "/v1/node").json()["runtime"]
    assert (runtime["platform"], runtime["platform_reason"]) == ("ptrace", "configured")
    created = server.create()
    assert server.run(created["id"], ["true"])["exit_code"] == 0
    assert _sandbox_platform(created["id"]) == "ptrace"


def test_ptrace_where_systrap_does_not_boot(
    sandboxd_factory: Callable[..., Sandboxd], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host where systrap cannot run (here: a runsc wrapper refusing it for the probe) gets ptrace, says
    why, and its sandboxes work."""
    real = RUNSC
    if "systrap" not in inspect_runsc(real).platforms:
        pytest.skip(
            f"runsc {inspect_runsc(real).version} has no systrap to fall back from; install.sh installs one"
        )
    wrapper = tmp_path / "bin" / "runsc"
    wrapper.parent.mkdir()
    wrapper.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" --platform=systrap run "*" probe-"*)\n'
        '    echo "systrap refused by the test" >&2; exit 1 ;;\n'
        "esac\n"
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setattr(sandboxd_harness, "RUNSC", str(wrapper))  # the server's [paths] runsc
    server = sandboxd_factory()
    runtime = server.request("GET", "/v1/node").json()["runtime"]
    assert runtime["platform"] == "ptrace"
    assert (
        runtime["platform_reason"] == "a probe sandbox on systrap failed: exit 1: systrap refused by the test"
    )
    assert any("platform ptrace" in line for line in runtime["limitations"])
    assert "sandboxes run on the ptrace platform" in server.log_text()
    created = server.create()
    assert server.run(created["id"], ["echo", "hi"])["stdout"] == b"hi\n"
    assert _sandbox_platform(created["id"]) == "ptrace"
