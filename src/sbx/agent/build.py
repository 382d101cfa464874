"""Build the static sbx-agent binary from agent.c.

``python -m sbx.agent.build --out PATH`` compiles with ``gcc -static -O2 -Wall -Wextra`` and prints
the path. Building is skipped when the output is newer than every source, so installers and tests
can call it unconditionally. The binary is static so it runs in any image (musl, distroless).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sbx.api.errors import Internal

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = (SOURCE_DIR / "agent.c",)
CFLAGS = ("-static", "-O2", "-Wall", "-Wextra")
"""Warnings do not fail an install; tests compile with -Werror to keep the source warning-free."""


class AgentBuildError(Internal):
    """The agent could not be compiled; the message carries the compiler's output."""


def _up_to_date(out: Path) -> bool:
    try:
        built = out.stat().st_mtime_ns
    except FileNotFoundError:
        return False
    return all(src.stat().st_mtime_ns <= built for src in SOURCES) and os.access(out, os.X_OK)


def ensure_agent(path: Path, cc: str = "gcc") -> Path:
    """Compile the agent to ``path`` unless it is already newer than the sources; returns ``path``.

    Raises AgentBuildError if the compiler is missing or fails (libc6-dev provides the static libc).
    """
    path = Path(path)
    if _up_to_date(path):
        return path
    if shutil.which(cc) is None:
        raise AgentBuildError(
            f"cannot build sbx-agent: {cc} is not installed (apt-get install gcc libc6-dev)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a concurrent caller never runs a half-written binary.
    fd, tmp = tempfile.mkstemp(prefix=".sbx-agent-", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *CFLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise AgentBuildError(f"cannot build sbx-agent with {cc}:\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sbx.agent.build", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="where to write the agent binary")
    parser.add_argument("--cc", default="gcc", help="C compiler (default gcc)")
    args = parser.parse_args(argv)
    try:
        print(ensure_agent(args.out, args.cc))
    except AgentBuildError as e:
        print(f"AgentBuildError: {e.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
