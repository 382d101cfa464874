"""runsc/seccompgen, which puts the sentry's seccomp programs into the runsc scripts/install.sh builds
(docs/backends.md, "The sentry's seccomp filter, precompiled"): its Go tests, run with the Go install.sh uses.
That the runsc built loads them is tests/integration/test_runsc_build.py's."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

RUNSC_MODULE = Path(__file__).resolve().parents[2] / "runsc"


def _go() -> str:
    """The Go scripts/install.sh builds runsc with (its find_go: PATH, then Go's and Debian's usual places)."""
    for candidate in (shutil.which("go"), "/usr/local/go/bin/go", "/usr/lib/go/bin/go"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise AssertionError("no Go found: run scripts/install.sh, which installs one to build runsc with")


def test_the_generator_fills_only_the_stub_it_knows() -> None:
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "auto", "GOFLAGS": "-mod=readonly"}
    result = subprocess.run(
        [_go(), "test", "-count=1", "./seccompgen"],
        cwd=RUNSC_MODULE, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok" in result.stdout and "sbx.invalid/runsc/seccompgen" in result.stdout
