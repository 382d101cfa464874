"""The runsc scripts/install.sh builds: every sandbox's sentry installs its seccomp filter from a program compiled
into runsc (runsc/seccompgen), at a boot and at a restore, on each platform sandboxd may choose, with the
flags sandboxd gives it (docs/backends.md, "The sentry's seccomp filter, precompiled")."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import sandboxd_harness
from sandboxd_harness import DATA_ROOT, Sandboxd

#: The binary install.sh builds (whatever SBX_RUNSC names for the rest of the suite).
INSTALLED_RUNSC = DATA_ROOT / "runsc" / "runsc"
#: What the sentry logs (at debug level) for each way of installing its filter (runsc/boot/filter/filter.go).
PRECOMPILED = "Loaded precompiled seccomp instructions"
FROM_RULES = "No precompiled program found"


@pytest.mark.parametrize("platform", ["systrap", "ptrace"])
def test_the_sentry_filter_is_precompiled_at_boot_and_restore(
    sandboxd_factory: Callable[..., Sandboxd], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, platform: str
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    wrapper = tmp_path / "bin" / "runsc"
    wrapper.parent.mkdir()
    # runsc's own debug log, one file per command and sandbox; everything else as sandboxd asks.
    wrapper.write_text(
        f'#!/bin/sh\nexec {INSTALLED_RUNSC} --debug --debug-log="{logs}/%ID%.%COMMAND%.%TIMESTAMP%" "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setattr(sandboxd_harness, "RUNSC", str(wrapper))
    server = sandboxd_factory(f'[gvisor]\nplatform = "{platform}"\n')
    ref = server.create()["id"]
    assert server.run(ref, ["true"])["exit_code"] == 0
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    assert server.request("POST", f"/v1/sandboxes/{ref}/resume").status == 200
    assert server.run(ref, ["true"])["exit_code"] == 0
    boots = sorted(logs.glob(f"{ref}.boot.*"))
    assert len(boots) == 2, [p.name for p in logs.iterdir()]  # the run's sentry, then the restore's
    for boot in boots:
        text = boot.read_text(errors="replace")
        assert f"Platform: {platform}" in text, boot.name
        assert PRECOMPILED in text and FROM_RULES not in text, boot.name
