#!/usr/bin/env bash
# Remake requirements.lock, the pinned Python dependency set (with hashes) that scripts/install.sh installs.
#
#   bash scripts/lock.sh                 re-resolve after editing pyproject.toml's dependencies (keeps the
#                                        other pins where they still fit)
#   bash scripts/lock.sh --upgrade       move every pin to the newest release that fits
#   bash scripts/lock.sh --upgrade-package msgspec   move one pin
#
# Then run scripts/install.sh (it reinstalls the virtualenv when the lock changed) and scripts/test.sh, and
# commit requirements.lock together with whatever the new versions regenerate (docs/openapi.yaml comes from
# msgspec: `python -m sbx.api.openapi > docs/openapi.yaml`, then `npm run generate` in sdk/typescript).
#
# The resolver is uv, pinned below and installed into its own virtualenv under /var/cache/sbx (never into .venv,
# so the project's own dependency set stays exactly the lock). The lock is universal (markers for every
# platform) and for Python 3.11, Debian 12's python3.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOCK=$REPO/requirements.lock
UV_VERSION=0.13.9
TOOLS=/var/cache/sbx/lock-tools-uv-$UV_VERSION
PYTHON_VERSION=3.11

if [ ! -x "$TOOLS/bin/uv" ]; then
    rm -rf "$TOOLS"
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install --disable-pip-version-check -q "uv==$UV_VERSION"
fi

cd "$REPO"
# Besides pyproject.toml's dependencies (with the test extra), the build backend of [build-system] (from stdin):
# install.sh builds the editable checkout with it, offline (--no-build-isolation), so that too is pinned.
build_backend=$("$TOOLS/bin/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
printf '%s\n' "$build_backend" |
    "$TOOLS/bin/uv" pip compile pyproject.toml - --extra test --universal --python-version "$PYTHON_VERSION" \
        --generate-hashes --quiet --custom-compile-command "bash scripts/lock.sh" -o "$LOCK" "$@"
