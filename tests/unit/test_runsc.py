"""What sandboxd reads from runsc: release, flags, platforms, and the platform probe's verdicts.

Fake ``runsc`` programs (shell scripts printing what a release prints) stand in for the real one; the real
releases are exercised by the integration tests.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from sbx.backends.base import BackendError
from sbx.backends.runsc import RunscInfo, choose_platform, dentry_cache_size, inspect_runsc, probe_platform

FLAGS_20240729 = """\
  -overlay2 value
    \twrap mounts with overlayfs. Format is {mount}:{medium}, ... (default root:self)
  -platform string
    \tspecifies which platform to use: systrap (default), ptrace, kvm. (default "systrap")
  -directfs
    \tdirectly access the container filesystems from the sentry. (default true)
"""
FLAGS_20221219 = """\
  -overlay2 value
    \twrap mounts with overlayfs. 'none' will turn overlay mode off.
  -platform string
    \tspecifies which platform to use: ptrace (default), kvm. (default "ptrace")
"""
FLAGS_ANCIENT = """\
  -platform string
    \tthe platform
"""


def fake_runsc(tmp_path: Path, version: str, flags: str, run: str = "exit 0") -> str:
    """A runsc answering ``--version`` and ``flags`` (on stderr, as real releases do) and running ``run``
    for any other command."""
    path = tmp_path / "runsc"
    path.write_text(
        "#!/bin/sh\n"
        f"if [ \"$1\" = --version ]; then printf '%s\\nspec: 1.0.2-dev\\n' '{version}'; exit 0; fi\n"
        f"if [ \"$1\" = flags ]; then cat >&2 <<'EOF'\n{flags}EOF\nexit 0; fi\n"
        f"{run}\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# (case, version line, flags text, release, platforms, --overlay2=none passed, procfs mask needed)
INSPECT_CASES = [
    ("bookworm-backports", "runsc version 0.0~20240729.0", FLAGS_20240729, 20240729,
     ("systrap", "ptrace", "kvm"), True, True),
    ("debian 12", "runsc version 0.0~20221219.0", FLAGS_20221219, 20221219, ("ptrace", "kvm"), True, True),
    ("upstream release tag", "runsc version release-20250101.0", FLAGS_20240729, 20250101,
     ("systrap", "ptrace", "kvm"), True, False),
    ("source build without a date", "runsc version 0.0.0", FLAGS_20240729, 0, ("systrap", "ptrace", "kvm"),
     True, True),
    ("unreadable platform help", "runsc version 0.0~20240729.0", FLAGS_ANCIENT, 20240729, ("ptrace",), False,
     True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("version", "flags", "release", "platforms", "overlay_none", "procfs_mask"),
    [c[1:] for c in INSPECT_CASES],
    ids=[c[0] for c in INSPECT_CASES],
)
def test_inspect(
    tmp_path: Path,
    version: str,
    flags: str,
    release: int,
    platforms: tuple[str, ...],
    overlay_none: bool,
    procfs_mask: bool,
) -> None:
    info = inspect_runsc(fake_runsc(tmp_path, version, flags))
    assert info.release == release
    assert info.version == version.removeprefix("runsc version ")
    assert info.platforms == platforms
    assert ("--overlay2=none" in info.start_flags("systrap")) is overlay_none
    assert info.start_flags("ptrace")[0] == "--platform=ptrace"
    assert info.netns_needs_procfs_mask is procfs_mask


# (case, configured, RLIMIT_NOFILE hard limit, --dcache)
DENTRY_CACHE_CASES = [
    ("configured wins whatever the limit", 50000, 1024, 50000),
    ("this machine's 20000", 0, 20000, 7952),
    ("pid 1's 32768", 0, 32768, 14336),
    ("systemd's 524288: capped", 0, 524288, 16384),
    ("a tiny limit: runsc's own size, never less", 0, 1024, 1000),
    ("just the reserve", 0, 4096, 1000),
]  # fmt: skip


@pytest.mark.parametrize(
    ("configured", "limit", "size"),
    [c[1:] for c in DENTRY_CACHE_CASES],
    ids=[c[0] for c in DENTRY_CACHE_CASES],
)
def test_dentry_cache_size(configured: int, limit: int, size: int) -> None:
    assert dentry_cache_size(configured, limit) == size


def test_dentry_cache_flag() -> None:
    info = inspect_runsc_from_flags("  -dcache int\n  -overlay2 value\n")
    assert "--dcache=8000" in info.start_flags("systrap", 8000)
    assert not any(f.startswith("--dcache") for f in info.start_flags("systrap", 0))
    old = inspect_runsc_from_flags("  -overlay2 value\n")
    assert not any(f.startswith("--dcache") for f in old.start_flags("systrap", 8000))


def inspect_runsc_from_flags(flags: str) -> RunscInfo:
    return RunscInfo(
        "/usr/bin/runsc", "0.0~20240729.0", 20240729, frozenset(re.findall(r"-(\w+)", flags)), ("systrap",)
    )


def test_release_older_than_the_minimum_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BackendError) as info:
        inspect_runsc(fake_runsc(tmp_path, "runsc version 0.0~20220510.0", FLAGS_20221219))
    assert "older than release 20221219" in str(info.value)
    assert "scripts/install.sh" in str(info.value)


def test_missing_runsc_names_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-runsc"
    with pytest.raises(BackendError) as info:
        inspect_runsc(str(missing))
    assert str(info.value) == (
        f"runsc not found at {missing}: run scripts/install.sh, which builds gVisor's runsc there, or name "
        "another one with [paths] runsc"
    )


# (case, release, platform, expected phrases, phrases that must not appear)
LIMITATION_CASES = [
    ("new release on systrap", 20240729, "systrap", ["extended attributes", "cpus 1 sees 2 CPUs"],
     ["statx", "ptrace", "^D"]),
    ("old release on ptrace", 20221219, "ptrace", ["statx", "ignore ^D", "platform ptrace"], []),
    ("unknown release", 0, "systrap", ["names no release"], ["statx"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("release", "platform", "present", "absent"),
    [c[1:] for c in LIMITATION_CASES],
    ids=[c[0] for c in LIMITATION_CASES],
)
def test_limitations(release: int, platform: str, present: list[str], absent: list[str]) -> None:
    info = RunscInfo("/usr/bin/runsc", f"0.0~{release}.0", release, frozenset(), ("systrap", "ptrace"))
    text = " | ".join(info.limitations(platform))
    assert all(p in text for p in present), text
    assert not any(a in text for a in absent), text


def test_configured_platform_is_used_without_a_probe(tmp_path: Path) -> None:
    # A runsc that fails every command: the configured platform must not be probed.
    info = inspect_runsc(fake_runsc(tmp_path, "runsc version 0.0~20240729.0", FLAGS_20240729, run="exit 7"))
    assert choose_platform(info, "ptrace", tmp_path / "agent", tmp_path / "work") == ("ptrace", "configured")
    assert choose_platform(info, "systrap", tmp_path / "agent", tmp_path / "work") == (
        "systrap",
        "configured",
    )


def test_configured_platform_this_runsc_lacks_is_refused(tmp_path: Path) -> None:
    info = inspect_runsc(fake_runsc(tmp_path, "runsc version 0.0~20221219.0", FLAGS_20221219))
    with pytest.raises(BackendError) as err:
        choose_platform(info, "systrap", tmp_path / "agent", tmp_path / "work")
    assert str(err.value) == (
        "[gvisor] platform = 'systrap', but runsc 0.0~20221219.0 offers only ptrace, kvm; "
        "choose one of those or 'auto'"
    )


# (case, what the fake runsc does when asked to run the probe, chosen platform, reason contains)
AUTO_CASES = [
    ("systrap boots", "echo 'sbx-agent protocol 3'; exit 0", "systrap", "probed"),
    ("systrap fails", "echo 'FATAL ERROR: systrap unsupported' >&2; exit 128", "ptrace",
     "a probe sandbox on systrap failed: exit 128: FATAL ERROR: systrap unsupported"),
    ("exit 0 without the agent's answer", "exit 0", "ptrace", "exit 0"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("run", "chosen", "reason"), [c[1:] for c in AUTO_CASES], ids=[c[0] for c in AUTO_CASES]
)
def test_auto_probes_systrap(tmp_path: Path, run: str, chosen: str, reason: str) -> None:
    # The probe's `run` and the cleanup's `delete` both reach the script; only `run` answers.
    script = f'case " $* " in *" run "*) {run} ;; esac'
    info = inspect_runsc(fake_runsc(tmp_path, "runsc version 0.0~20240729.0", FLAGS_20240729, run=script))
    platform, why = choose_platform(info, "auto", tmp_path / "agent", tmp_path / "work")
    assert (platform, reason in why) == (chosen, True), why
    assert os.listdir(tmp_path / "work") == []  # the probe's directory is gone


def test_auto_without_systrap_takes_ptrace_unprobed(tmp_path: Path) -> None:
    info = inspect_runsc(fake_runsc(tmp_path, "runsc version 0.0~20221219.0", FLAGS_20221219, run="exit 9"))
    platform, why = choose_platform(info, "auto", tmp_path / "agent", tmp_path / "work")
    assert (platform, why) == ("ptrace", "runsc 0.0~20221219.0 has no systrap platform")


def test_probe_that_hangs_times_out_and_is_cleaned_up(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    script = f'echo "$*" >> {log}; case " $* " in *" run "*) exec sleep 30 ;; esac'
    info = inspect_runsc(fake_runsc(tmp_path, "runsc version 0.0~20240729.0", FLAGS_20240729, run=script))
    assert probe_platform(info, "systrap", tmp_path / "agent", tmp_path / "work", timeout_secs=0.5) == (
        "no answer within 0.5 s"
    )
    calls = log.read_text().splitlines()
    assert "--platform=systrap run --bundle" in calls[0] and " delete --force probe-" in calls[1]
    assert os.listdir(tmp_path / "work") == []


@pytest.mark.parametrize(
    ("version", "release", "platform", "refused"),
    [
        ("0.0~20240729.0", 20240729, "systrap", False),  # before seccomp-notified syscall threads
        ("release-20250618.0", 20250618, "systrap", False),
        ("release-20250625.0", 20250625, "systrap", True),  # the first release with them
        ("release-20260803.0-49-g7a7d8c355", 20260803, "systrap", True),  # the pinned build
        ("release-20260803.0-49-g7a7d8c355", 20260803, "ptrace", False),  # no syscall threads on ptrace
        ("VERSION_MISSING", 0, "systrap", True),  # a build naming no release counts as a current one
    ],
)
def test_parking_is_refused_where_freezing_breaks_systrap(
    version: str, release: int, platform: str, refused: bool
) -> None:
    info = RunscInfo("/var/lib/sandboxd/runsc/runsc", version, release, frozenset(), ("systrap", "ptrace"))
    reason = info.parking_refused(platform)
    if not refused:
        assert reason is None
    else:
        assert reason == (
            f"idle sandboxes are not parked: on runsc {version} with systrap, freezing a sandbox kills the "
            "guest's next process (its seccomp-notified syscall thread is interrupted), and an idle sandbox "
            "uses no CPU without it"
        )


# (case, version line, sized root overlay)
SIZED_OVERLAY_CASES = [
    ("the pinned release", "runsc version release-20260803.0-49-g7a7d8c355", True),
    ("the first with size= and tar rootfs-upper", "runsc version release-20250721.0", True),
    ("size= but no tar rootfs-upper yet", "runsc version release-20250611.0", False),
    ("bookworm-backports", "runsc version 0.0~20240729.0", False),
    ("a build naming no release", "runsc version 0.0.0", False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("version", "sized"), [c[1:] for c in SIZED_OVERLAY_CASES], ids=[c[0] for c in SIZED_OVERLAY_CASES]
)
def test_sized_root_overlay_by_release(tmp_path: Path, version: str, sized: bool) -> None:
    assert inspect_runsc(fake_runsc(tmp_path, version, FLAGS_20240729)).sized_root_overlay is sized


def test_root_overlay_flag_replaces_none() -> None:
    info = inspect_runsc_from_flags("  -overlay2 value\n")
    flags = info.start_flags("systrap", 0, "--overlay2=root:dir=/x,size=1048576")
    assert "--overlay2=root:dir=/x,size=1048576" in flags and "--overlay2=none" not in flags


# (case, build.txt beside the binary (None: no file), patches read)
BUILD_RECORD_CASES = [
    ("no record: Debian's or another build", None, frozenset()),
    ("a record before patches were named", "CGO_ENABLED=0; sentry seccomp programs precompiled by runsc/seccompgen",
     frozenset()),
    ("the patch that streams the tar", "CGO_ENABLED=0; patches: tmpfs-tar-streams-files@30cf98401d5c\n",
     frozenset({"tmpfs-tar-streams-files"})),
    ("two patches", "x; patches: a@111 b@222", frozenset({"a", "b"})),
    ("none listed", "x; patches:", frozenset()),
]  # fmt: skip


@pytest.mark.parametrize(
    ("record", "patches"), [c[1:] for c in BUILD_RECORD_CASES], ids=[c[0] for c in BUILD_RECORD_CASES]
)
def test_patches_are_read_from_the_build_record_beside_the_binary(
    tmp_path: Path, record: str | None, patches: frozenset[str]
) -> None:
    """Through the link scripts/install.sh makes (``runsc`` -> ``<version>/runsc``), as sandboxd finds it."""
    (tmp_path / "v1").mkdir()
    binary = fake_runsc(tmp_path / "v1", "runsc version release-20260803.0", FLAGS_20240729)
    if record is not None:
        (tmp_path / "v1" / "build.txt").write_text(record)
    (tmp_path / "runsc").symlink_to("v1/runsc")
    info = inspect_runsc(str(tmp_path / "runsc"))
    assert info.patches == patches
    assert info.overlay_tar_streams is ("tmpfs-tar-streams-files" in patches)
    assert binary == str(tmp_path / "v1" / "runsc")
