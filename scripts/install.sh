#!/usr/bin/env bash
# Install everything sandboxd needs on Debian 12 and (re)start it on /run/sandboxd.sock.
#
#   bash scripts/install.sh             install, then start or restart sandboxd (as root)
#   bash scripts/install.sh --no-start  install only
#   bash scripts/install.sh --no-start --test-deps  also what the tests need (scripts/test.sh)
#
# Idempotent: each step checks first and does nothing when already done, so a second run takes seconds.
# Steps: apt packages (apt-get update only when one is missing; Go from bookworm-backports when the machine has
# none, and with --test-deps Debian's runsc from there too, whose apt source is added when missing), gVisor's
# runsc built from its Go module at the version runsc/go.mod pins (once: the binary is kept), the virtualenv
# .venv with this checkout installed editable, the web console (npm ci and its build, docs/console.md), the
# TypeScript SDK (npm ci and tsc, docs/sdk-typescript.md), the guest agent binary, the default image, the kernel
# limits a node of many sandboxes needs (kernel.pid_max), then sandboxd under systemd (when systemd is PID 1, with
# LimitNOFILE raised) or as a daemon with a pidfile. Paths and details: docs/install.md.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DATA_ROOT=/var/lib/sandboxd
IMAGES_DIR=$DATA_ROOT/images
AGENT_PATH=$DATA_ROOT/agent/sbx-agent
STATE_DIR=$DATA_ROOT/state
SOCKET=/run/sandboxd.sock
PIDFILE=/run/sandboxd.pid
LOG=/var/log/sandboxd.log
UNIT=/etc/systemd/system/sandboxd.service
# Kernel limits a node of many sandboxes needs (docs/install.md, "Limits for many sandboxes").
SYSCTL_FILE=/etc/sysctl.d/60-sandboxd.conf
PID_MAX=4194304
# Default send buffer of new sockets (bytes): caps each write gVisor makes to a host unix socket (tunnels).
WMEM_DEFAULT=1048576
# sandboxd's open files: one or two per sandbox, plus its clients' connections and the egress proxy's.
NOFILE_LIMIT=1048576
VENV=$REPO/.venv
# Debian's own interpreter: the venv must not depend on a pyenv or other python found first on PATH.
SYSTEM_PYTHON=/usr/bin/python3
STAMP=$VENV/.sbx-install-stamp
START_TIMEOUT_SECS=60

# gVisor, the sandbox runtime: runsc built from the Go module gvisor.dev/gvisor at the version runsc/go.mod pins
# (its `// release:` line names it), into $RUNSC_HOME/<version>/runsc; sandboxd runs $RUNSC_HOME/runsc, a link to
# it ([gvisor] runsc in its config; docs/backends.md says why this version, docs/install.md how to change it).
RUNSC_MODULE=$REPO/runsc
RUNSC_HOME=$DATA_ROOT/runsc
# Go builds it: the machine's (on PATH or /usr/local/go), else Debian's from bookworm-backports, which fetches the
# toolchain go.mod names from the Go module proxy (GOTOOLCHAIN=auto).
BACKPORTS_SUITE=bookworm-backports
BACKPORTS_SOURCES=/etc/apt/sources.list.d/sbx-bookworm-backports.sources
APT_PACKAGES=(
    mmdebstrap debian-archive-keyring  # builds the default image
    e2fsprogs               # mkfs.ext4, e2fsck, resize2fs: writable layers, volumes, snapshot copies
    erofs-utils             # mkfs.erofs: each image's /usr as an EROFS image gVisor reads itself
    util-linux mount        # umount, fsfreeze (disk snapshots), setsid, flock
    patch                   # applies runsc/patches/ onto gVisor's source before runsc is built
    iproute2                # ip, for sandbox networking
    nftables                # nft: sandbox egress rules (docs/network.md)
    procps                  # ps, pkill used by tests and diagnostics
    passwd                  # groupadd/useradd --root for the image's sandbox user
    gcc libc6-dev           # the guest agent is C, linked statically
    python3 python3-venv python3-dev
    ca-certificates curl    # curl talks to the socket below and in README examples
)
# Only with --test-deps (scripts/test.sh): never on a node that only serves sandboxes.
TEST_APT_PACKAGES=(
    docker-registry apache2-utils openssl  # a loopback registry to pull from, htpasswd, token certs
    skopeo                  # bench/bench_pull.py compares our pull with it
    prometheus              # promtool: the tests lint both servers' metrics with it
    openssh-client          # ssh, scp and sftp: the tests log in through the gateway's SSH server
    chromium fonts-dejavu-core  # the web console's tests drive Debian's Chromium (Playwright)
    postgresql              # PostgreSQL 15's initdb/pg_ctl: the tests start a private cluster (docs/ha.md)
    haproxy                 # the replicas' test runs them behind a real HAProxy on loopback (docs/ha.md)
    runsc                   # Debian's gVisor, from $BACKPORTS_SUITE: test_runtime_upgrade makes old state with it
)
# The oldest Debian runsc the upgrade test runs as "the old runsc" (20221219, bookworm's own, has another control
# socket the pinned runsc cannot reach); sandboxd itself never runs it unless [paths] runsc names it.
TEST_RUNSC_VERSION=0.0~20240729.0
# Node.js and npm build the web console; Debian's, unless some node and npm are already installed (a packaged
# node that bundles npm would conflict with Debian's npm package).
NODE_APT_PACKAGES=(nodejs npm)

ARGS="$*"
START=1
TEST_DEPS=0
usage() {
    sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}
while [ $# -gt 0 ]; do
    case "$1" in
        --no-start) START=0 ;;
        --test-deps) APT_PACKAGES+=("${TEST_APT_PACKAGES[@]}"); TEST_DEPS=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
    esac
    shift
done

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    APT_PACKAGES+=("${NODE_APT_PACKAGES[@]}")
fi

T0=$SECONDS
step() { printf '==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }
die() {
    printf '\ninstall.sh: error: %s\n' "$1" >&2
    shift
    for line in "$@"; do printf '    %s\n' "$line" >&2; done
    exit 1
}
trap 'rc=$?; [ $rc -eq 0 ] || printf "install.sh: failed (exit %s) at line %s: %s\n" "$rc" "$LINENO" "$BASH_COMMAND" >&2' ERR

[ "$(id -u)" -eq 0 ] || die "install.sh must run as root (it installs packages and runs gVisor)" \
    "run it as root: bash scripts/install.sh $ARGS (from a root shell, or through sudo or su)"
command -v apt-get >/dev/null && command -v dpkg-query >/dev/null ||
    die "apt-get not found: this script supports Debian 12 only" \
        "elsewhere install the equivalents of: ${APT_PACKAGES[*]}"

# --- 1. apt packages ------------------------------------------------------------------------------------------
step "apt packages"
installed_version() {  # the installed version of package $1, empty when it is not installed
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" = installed ] &&
        dpkg-query -W -f='${Version}' "$1" 2>/dev/null
}
# The machine's own Go (on PATH or /usr/local/go), else Debian's (from the backports package installed below).
find_go() {
    local go
    for go in "$(command -v go 2>/dev/null)" /usr/local/go/bin/go /usr/lib/go/bin/go; do
        [ -n "$go" ] && [ -x "$go" ] && { printf '%s\n' "$go"; return 0; }
    done
    return 1
}
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    have=$(installed_version "$pkg" || true)
    if [ -z "$have" ] || { [ "$pkg" = runsc ] && ! dpkg --compare-versions "$have" ge "$TEST_RUNSC_VERSION"; }; then
        missing+=("$pkg")
    fi
done
if ! find_go >/dev/null; then
    missing+=(golang-go)  # from $BACKPORTS_SUITE (bookworm's own 1.19 cannot fetch a newer toolchain)
fi

# The first apt source of Debian's bookworm suite (one-line or deb822 format), else deb.debian.org: where
# backports come from when no source names them yet.
debian_mirror() {
    local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources) found
    found=$({ cat "${files[@]}" 2>/dev/null || true; } | awk '
        function stanza_end() { if (uri != "" && suites ~ /(^| )bookworm( |$)/) print uri; uri = ""; suites = "" }
        /^[[:space:]]*#/ { next }
        /^[[:space:]]*$/ { stanza_end(); next }
        $1 == "deb" {
            n = 0
            for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/ && $i !~ /=/) word[++n] = $i
            if (n >= 2 && word[2] == "bookworm") print word[1]
            next
        }
        tolower($1) == "uris:" { uri = $2 }
        tolower($1) == "suites:" { $1 = ""; suites = $0 " " }
        END { stanza_end() }' | grep -m1 -E '^(https?|file):' || true)
    printf '%s\n' "${found%/}" | sed 's|^$|http://deb.debian.org/debian|'
}
# Whether an enabled apt source names the backports suite (apt itself is the judge once lists are read).
has_backports_source() {
    apt-get -q -o Dpkg::Use-Pty=0 indextargets --format '$(RELEASE)' 2>/dev/null | grep -qx "$BACKPORTS_SUITE" ||
        grep -qsE "^[^#]*[[:space:]]$BACKPORTS_SUITE([[:space:]]|\$)" /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
            /etc/apt/sources.list.d/*.sources
}

if [ ${#missing[@]} -eq 0 ]; then
    note "all ${#APT_PACKAGES[@]} present"
else
    note "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt_opts=(-q -o DPkg::Lock::Timeout=300 -o Dpkg::Use-Pty=0)
    if [[ " ${missing[*]} " == *" golang-go "* || " ${missing[*]} " == *" runsc "* ]] && ! has_backports_source; then
        mirror=$(debian_mirror)
        note "adding the apt source $BACKPORTS_SUITE from $mirror ($BACKPORTS_SOURCES)"
        printf '%s\n' "# Added by sbx scripts/install.sh: Go (to build gVisor's runsc) and the tests' Debian runsc come from here (docs/install.md)." \
            "Types: deb" "URIs: $mirror" "Suites: $BACKPORTS_SUITE" "Components: main" \
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" >"$BACKPORTS_SOURCES"
    fi
    apt-get "${apt_opts[@]}" update ||
        die "apt-get update failed" "check /etc/apt/sources.list* and the network, then run this again"
    install_args=()
    for pkg in "${missing[@]}"; do
        if [ "$pkg" = golang-go ] || [ "$pkg" = runsc ]; then
            install_args+=("$pkg/$BACKPORTS_SUITE")
        else
            install_args+=("$pkg")
        fi
    done
    apt-get "${apt_opts[@]}" install -y --no-install-recommends "${install_args[@]}" ||
        die "apt-get install failed for: ${install_args[*]}" \
            "on Debian 12 these are in main and $BACKPORTS_SUITE; fix the apt error above and run this again"
fi
if [ "$TEST_DEPS" = 1 ] && [ -d /run/systemd/system ]; then
    # Debian's packages enable a registry, a Prometheus server, a PostgreSQL cluster and HAProxy; tests only need
    # the registry binary (they start their own on loopback), promtool, PostgreSQL's binaries (a private cluster
    # in a temporary directory, tests/support/pg_cluster.py) and haproxy (started by its test on loopback).
    for service in docker-registry prometheus postgresql haproxy; do
        if systemctl is-enabled --quiet "$service" 2>/dev/null; then
            systemctl disable --now "$service" >/dev/null 2>&1 || true
            note "disabled the $service service the package enabled (tests need only its tools)"
        fi
    done
fi
[ -x "$SYSTEM_PYTHON" ] || die "$SYSTEM_PYTHON is missing although python3 is installed" \
    "reinstall it: apt-get install --reinstall python3"

# --- 1b. runsc, built from gVisor's Go module ------------------------------------------------------------------
# Once per pinned version: the binary is kept in $RUNSC_HOME/<version>/ (a second install only checks it). The
# build verifies every module against runsc/go.sum (-mod=readonly), so the sum database is not needed; without the
# Go module proxy, see docs/install.md ("Without access to the Go module proxy").
RUNSC_PIN=$(awk '$1 == "require" && $2 == "gvisor.dev/gvisor" { print $3 }' "$RUNSC_MODULE/go.mod")
RUNSC_RELEASE=$(sed -n 's|^// release: \([^ ]*\).*|\1|p' "$RUNSC_MODULE/go.mod")
[ -n "$RUNSC_PIN" ] && [ -n "$RUNSC_RELEASE" ] ||
    die "runsc/go.mod names no gvisor.dev/gvisor version or no '// release:' line" "restore it from git"
RUNSC_BIN=$RUNSC_HOME/$RUNSC_PIN/runsc
# How the binary is built, besides the pin, written beside it as build.txt: a binary of the same version built
# another way (before the seccomp programs were precompiled, or copied in without this file) is built again.
# Each patch of runsc/patches/ (applied onto the vendored gVisor) is named with its digest, so a changed patch is
# built again; sandboxd reads the names (sbx.backends.runsc.RunscInfo.overlay_tar_streams).
RUNSC_PATCHES=$(cd "$RUNSC_MODULE/patches" && for p in *.patch; do
    printf ' %s@%s' "${p%.patch}" "$(sha256sum "$p" | cut -c1-12)"; done)
RUNSC_RECIPE="CGO_ENABLED=0; sentry seccomp programs precompiled by runsc/seccompgen; patches:$RUNSC_PATCHES"
step "runsc $RUNSC_RELEASE ($RUNSC_BIN)"
if [ -x "$RUNSC_BIN" ] && [ "$("$RUNSC_BIN" --version 2>/dev/null | head -n 1)" = "runsc version $RUNSC_RELEASE" ] &&
    [ "$(cat "$RUNSC_HOME/$RUNSC_PIN/build.txt" 2>/dev/null)" = "$RUNSC_RECIPE" ]; then
    note "up to date"
else
    GO=$(find_go) || die "no Go to build runsc with although golang-go was to be installed" \
        "install Go 1.26 (apt-get install -t $BACKPORTS_SUITE golang-go) and run this again"
    note "building gvisor.dev/gvisor/runsc@$RUNSC_PIN with $("$GO" version) (about 1 to 3 minutes, once)"
    install -d -m 0755 "$RUNSC_HOME"
    build_dir=$(mktemp -d "$RUNSC_HOME/.build-XXXXXX")
    chmod 0755 "$build_dir"
    # GOTOOLCHAIN=auto: Debian's Go is older than the module asks and, as packaged, never fetches a newer one.
    # gVisor's Go branch ships runsc/boot/filter/filter_precompiled.go with no program in it, so every sandbox
    # boot and restore would build its seccomp filter from the rules (10-15 ms each, docs/backends.md);
    # seccompgen writes the file gVisor's own builds generate, and the build compiles it in the stub's place, in a
    # vendored copy of the pinned modules (go refuses to compile over files of its module cache), after the
    # patches of runsc/patches/ (each says why) are applied there.
    if ! (cd "$RUNSC_MODULE" && export CGO_ENABLED=0 GOTOOLCHAIN=auto GOFLAGS=-mod=readonly &&
            "$GO" mod download gvisor.dev/gvisor &&
            module_dir=$("$GO" list -m -f '{{.Dir}}' gvisor.dev/gvisor) &&
            "$GO" run ./seccompgen -stub "$module_dir/runsc/boot/filter/filter_precompiled.go" \
                -out "$build_dir/filter_precompiled.go" &&
            mkdir "$build_dir/src" && cp go.mod go.sum tools.go "$build_dir/src/" &&
            cd "$build_dir/src" && "$GO" mod vendor &&
            cp "$build_dir/filter_precompiled.go" vendor/gvisor.dev/gvisor/runsc/boot/filter/filter_precompiled.go &&
            for p in "$RUNSC_MODULE"/patches/*.patch; do
                patch -p1 --forward --batch --fuzz=0 --no-backup-if-mismatch -d vendor/gvisor.dev/gvisor < "$p" ||
                    { echo "$p does not apply onto gvisor.dev/gvisor@$RUNSC_PIN" >&2; exit 1; }
            done &&
            "$GO" build -mod=vendor -trimpath \
                -ldflags "-X gvisor.dev/gvisor/runsc/version.version=$RUNSC_RELEASE" \
                -o "$build_dir/runsc" gvisor.dev/gvisor/runsc); then
        rm -rf "$build_dir"
        die "building runsc failed (see go's messages above)" \
            "it needs the Go module proxy (GOPROXY, default https://proxy.golang.org) or a module cache holding" \
            "gvisor.dev/gvisor@$RUNSC_PIN; docs/install.md says how to build without them"
    fi
    "$build_dir/runsc" --version >/dev/null || { rm -rf "$build_dir"; die "the runsc just built does not run"; }
    # Each file in one rename: a running sandboxd (a rebuild of the same version) never finds runsc missing.
    install -d -m 0755 "$(dirname "$RUNSC_BIN")"
    mv -f "$build_dir/runsc" "$RUNSC_BIN"
    printf '%s\n' "$RUNSC_RECIPE" > "$build_dir/build.txt"
    mv -f "$build_dir/build.txt" "$RUNSC_HOME/$RUNSC_PIN/build.txt"
    rm -rf "$build_dir"
    note "built $("$RUNSC_BIN" --version | head -n 1)"
fi
# The path sandboxd runs by default: switched in one rename, so a running sandboxd never sees it missing.
if [ "$(readlink "$RUNSC_HOME/runsc" 2>/dev/null)" != "$RUNSC_PIN/runsc" ]; then
    ln -sfn "$RUNSC_PIN/runsc" "$RUNSC_HOME/.runsc-link"
    mv -T "$RUNSC_HOME/.runsc-link" "$RUNSC_HOME/runsc"
fi

# --- 2. virtualenv --------------------------------------------------------------------------------------------
step "virtualenv $VENV"
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
    note "existing virtualenv is broken or too old: recreating it"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$SYSTEM_PYTHON" -m venv "$VENV" ||
        die "could not create $VENV" "check that python3-venv is installed and the disk is writable"
fi
if ! grep -qx 'home = /usr/bin' "$VENV/pyvenv.cfg" 2>/dev/null; then
    note "note: $VENV was not made with $SYSTEM_PYTHON; delete it to have it recreated with Debian's python3"
fi
# Exactly the versions of requirements.lock (every package pinned with its hashes: pip refuses anything else),
# then this checkout editable without its dependencies, built by the venv's own setuptools (Debian's, offline).
# Reinstall only when the lock, pyproject.toml or the interpreter changed, or the package resolves to another
# checkout. The lock is remade from pyproject.toml's ranges by scripts/lock.sh.
want_stamp="$(cat "$REPO/requirements.lock" "$REPO/pyproject.toml" | sha256sum | cut -d' ' -f1) $("$VENV/bin/python" -V 2>&1)"
sbx_path=$("$VENV/bin/python" -c 'import sbx; print(sbx.__file__)' 2>/dev/null || true)
if [ "$(cat "$STAMP" 2>/dev/null)" = "$want_stamp" ] && [ "$sbx_path" = "$REPO/src/sbx/__init__.py" ]; then
    note "up to date"
else
    note "pip install --require-hashes -r requirements.lock; pip install --no-deps -e ."
    pip_opts=(--disable-pip-version-check -q)
    "$VENV/bin/python" -m pip install "${pip_opts[@]}" --require-hashes --no-deps -r "$REPO/requirements.lock" ||
        die "pip install of requirements.lock failed" "check access to PyPI (or a configured index) and run this again"
    "$VENV/bin/python" -m pip install "${pip_opts[@]}" --no-deps --no-build-isolation -e "$REPO" ||
        die "pip install -e $REPO failed" "see pip's message above"
    "$VENV/bin/python" -m pip check >/dev/null ||
        die "the installed packages do not fit together" "$("$VENV/bin/python" -m pip check 2>&1 | head -n 5)" \
            "remake the lock (bash scripts/lock.sh) and run this again"
    printf '%s\n' "$want_stamp" >"$STAMP"
fi

# --- 2b. the web console ----------------------------------------------------------------------------------------
# Its dependencies come from the npm registry pinned by console/package-lock.json (npm ci, no install scripts);
# the build (esbuild, offline) writes src/sbx/web/console_assets, which sandbox-gateway serves at /console/.
# Each part runs only when its inputs changed since the last run.
CONSOLE=$REPO/console
CONSOLE_OUT=$REPO/src/sbx/web/console_assets
step "web console ($CONSOLE_OUT)"
lock_sum=$(sha256sum "$CONSOLE/package-lock.json" | cut -d' ' -f1)
if [ "$(cat "$CONSOLE/node_modules/.sbx-lock-stamp" 2>/dev/null)" != "$lock_sum" ]; then
    note "npm ci"
    (cd "$CONSOLE" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error) ||
        die "npm ci failed in $CONSOLE" "check access to the npm registry (or a configured one) and run this again"
    printf '%s\n' "$lock_sum" >"$CONSOLE/node_modules/.sbx-lock-stamp"
fi
build_sum=$(cd "$CONSOLE" && find src build.mjs package-lock.json -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
if [ "$(cat "$CONSOLE_OUT/.sbx-build-stamp" 2>/dev/null)" = "$build_sum" ] && [ -f "$CONSOLE_OUT/index.html" ]; then
    note "up to date"
else
    (cd "$CONSOLE" && node build.mjs "$CONSOLE_OUT") ||
        die "building the web console failed" "see the messages above (node $(node --version 2>&1))"
    printf '%s\n' "$build_sum" >"$CONSOLE_OUT/.sbx-build-stamp"
fi

# --- 2c. the TypeScript SDK ------------------------------------------------------------------------------------
# sdk/typescript (docs/sdk-typescript.md): its dependencies (ws; tsc, openapi-typescript and type packages to build
# and test it) come from the npm registry pinned by its package-lock.json (npm ci, no install scripts); tsc builds
# dist/ offline. Each part runs only when its inputs changed since the last run.
SDK_TS=$REPO/sdk/typescript
step "TypeScript SDK ($SDK_TS/dist)"
lock_sum=$(sha256sum "$SDK_TS/package-lock.json" | cut -d' ' -f1)
if [ "$(cat "$SDK_TS/node_modules/.sbx-lock-stamp" 2>/dev/null)" != "$lock_sum" ]; then
    note "npm ci"
    (cd "$SDK_TS" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error) ||
        die "npm ci failed in $SDK_TS" "check access to the npm registry (or a configured one) and run this again"
    printf '%s\n' "$lock_sum" >"$SDK_TS/node_modules/.sbx-lock-stamp"
fi
build_sum=$(cd "$SDK_TS" && find src tsconfig.json package-lock.json -type f -print0 | sort -z | xargs -0 sha256sum |
    sha256sum | cut -d' ' -f1)
if [ "$(cat "$SDK_TS/dist/.sbx-build-stamp" 2>/dev/null)" = "$build_sum" ] && [ -f "$SDK_TS/dist/index.js" ]; then
    note "up to date"
else
    (cd "$SDK_TS" && node node_modules/typescript/bin/tsc -p tsconfig.json) ||
        die "building the TypeScript SDK failed" "see the messages above (node $(node --version 2>&1))"
    printf '%s\n' "$build_sum" >"$SDK_TS/dist/.sbx-build-stamp"
fi

# --- 3. data directories and the guest agent ----------------------------------------------------------------
step "guest agent $AGENT_PATH"
install -d -m 0700 "$DATA_ROOT" "$STATE_DIR"
install -d -m 0755 "$(dirname "$AGENT_PATH")"
if [ ! -f "$REPO/src/sbx/agent/build.py" ]; then
    die "src/sbx/agent/build.py is missing from this checkout, so the guest agent cannot be built" \
        "update the checkout (git pull) and run this again"
fi
"$VENV/bin/python" -m sbx.agent.build --out "$AGENT_PATH" ||
    die "building the guest agent failed" "see the compiler output above (needs gcc and libc6-dev)"

# --- 4. default image ---------------------------------------------------------------------------------------
step "default image in $IMAGES_DIR"
"$VENV/bin/python" -m sbx.images.default_image --images-dir "$IMAGES_DIR" ||
    die "building the default image failed" "see the messages above; rebuild later with:" \
        "$VENV/bin/python -m sbx.images.default_image --images-dir $IMAGES_DIR --force"
# Its /usr as an EROFS image (once; backends/usr_erofs.py): sandboxd would build it at the first boot otherwise.
"$VENV/bin/python" -m sbx.backends.usr_erofs "$IMAGES_DIR"/default-*/rootfs ||
    die "building the default image's EROFS /usr failed" "see the messages above"

# --- 5. kernel limits for many sandboxes ---------------------------------------------------------------------
# Every host thread takes a pid, and an idle gVisor sandbox holds 21-28 of them (its sentry, gofer and systrap
# stubs; more per guest process): the default kernel.pid_max of 32768 stops a node near 1,000 sandboxes with
# everything else the host runs, so it is raised to the 64-bit maximum (it only widens the range of pid numbers).
# kernel.threads-max (sized from memory by the kernel: about 190,000 on 24 GiB) is left as it is.
# net.core.wmem_default: gVisor writes to a host unix socket (the agent's channel and tunnel connections) at
# most the socket's send buffer at a time and may not change it (SO_SNDBUF is ignored for host-backed
# sockets), so the default of 208 KiB held tunnels to 550-800 MiB/s; 1 MiB gives 1.1-1.3 GiB/s
# (docs/benchmarks.md). It is a default (TCP has its own), memory is taken only by bytes queued.
step "kernel limits ($SYSCTL_FILE)"
sysctl_text="# Written by sbx's scripts/install.sh: room for thousands of gVisor sandboxes, fast tunnels (docs/install.md).
kernel.pid_max = $PID_MAX
net.core.wmem_default = $WMEM_DEFAULT"
if [ "$(cat "$SYSCTL_FILE" 2>/dev/null)" != "$sysctl_text" ]; then
    printf '%s\n' "$sysctl_text" >"$SYSCTL_FILE"
fi
current_pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 0)
if [ "$current_pid_max" -lt "$PID_MAX" ]; then
    sysctl -q -w "kernel.pid_max=$PID_MAX" >/dev/null 2>&1 ||
        note "kernel.pid_max stays $current_pid_max here (read-only /proc/sys, e.g. a container): sandboxd then holds fewer sandboxes and says why in GET /v1/node"
fi
current_wmem=$(cat /proc/sys/net/core/wmem_default 2>/dev/null || echo 0)
if [ "$current_wmem" -lt "$WMEM_DEFAULT" ]; then
    sysctl -q -w "net.core.wmem_default=$WMEM_DEFAULT" >/dev/null 2>&1 ||
        note "net.core.wmem_default stays $current_wmem here (read-only /proc/sys): tunnels out of sandboxes are slower (docs/install.md)"
fi

if [ "$START" -eq 0 ]; then
    step "installed in $((SECONDS - T0)) s (sandboxd not started: --no-start)"
    exit 0
fi

# --- 6. start sandboxd --------------------------------------------------------------------------------------
SANDBOXD=("$VENV/bin/sandboxd" --socket "$SOCKET" --state-dir "$STATE_DIR")
"$VENV/bin/python" -c 'import sbx.node.main' 2>/dev/null ||
    die "sbx.node.main cannot be imported, so sandboxd cannot start" \
        "$("$VENV/bin/python" -c 'import sbx.node.main' 2>&1 | tail -n 1)" \
        "update the checkout (git pull) and run this again"
touch "$LOG"

daemon_alive() {
    if [ "$MODE" = systemd ]; then
        systemctl is-active --quiet sandboxd
    else
        local pid
        pid=$(cat "$PIDFILE" 2>/dev/null) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
    fi
}

if [ -d /run/systemd/system ]; then
    MODE=systemd
    step "sandboxd under systemd ($UNIT)"
    # systemd's own quoting: each argument in double quotes, % doubled (it starts specifiers).
    exec_start=""
    for arg in "${SANDBOXD[@]}"; do exec_start+=" \"${arg//%/%%}\""; done
    unit_text="[Unit]
Description=sandboxd, the sandbox node server (gVisor)
Documentation=file://$REPO/docs/install.md
After=network.target

[Service]
Type=simple
ExecStart=${exec_start# }
# Sandboxes run outside sandboxd (runsc run --detach); stopping or restarting sandboxd must not kill them.
KillMode=process
# One or two descriptors per sandbox, plus clients and the egress proxy (systemd's default soft limit, 1024,
# would stop a node at a few hundred sandboxes).
LimitNOFILE=$NOFILE_LIMIT
Restart=on-failure
RestartSec=2
StandardOutput=append:$LOG
StandardError=append:$LOG

[Install]
WantedBy=multi-user.target"
    if [ "$(cat "$UNIT" 2>/dev/null)" != "$unit_text" ]; then
        printf '%s\n' "$unit_text" >"$UNIT"
        systemctl daemon-reload
    fi
    systemctl enable --quiet sandboxd
    systemctl restart sandboxd || die "systemctl restart sandboxd failed" "see: journalctl -u sandboxd; tail $LOG"
else
    MODE=pidfile
    step "sandboxd as a daemon (no systemd; pidfile $PIDFILE)"
    old=$(cat "$PIDFILE" 2>/dev/null || true)
    if [ -n "$old" ] && kill -0 "$old" 2>/dev/null && tr '\0' ' ' <"/proc/$old/cmdline" | grep -q sandboxd; then
        note "stopping the running sandboxd (pid $old); its sandboxes keep running"
        kill -TERM "$old"
        for _ in $(seq 1 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$old" 2>/dev/null; then
            note "still running after 10 s: killing it"
            kill -KILL "$old" 2>/dev/null || true
        fi
    fi
    rm -f "$PIDFILE"
    # As LimitNOFILE under systemd: room for the descriptors of thousands of sandboxes (a subshell, so this
    # shell keeps its own limit).
    # setsid: the daemon leaves this shell's session, so it survives the terminal or CI step that ran us.
    (ulimit -n "$NOFILE_LIMIT" 2>/dev/null || note "could not raise the open-file limit to $NOFILE_LIMIT"
     exec nohup setsid "${SANDBOXD[@]}" >>"$LOG" 2>&1 </dev/null) &
    echo $! >"$PIDFILE"
fi

note "waiting for $SOCKET to answer GET /v1/capabilities"
deadline=$((SECONDS + START_TIMEOUT_SECS))
until caps=$(curl -sS --fail --max-time 2 --unix-socket "$SOCKET" http://localhost/v1/capabilities 2>/dev/null); do
    if ! daemon_alive || [ $SECONDS -ge $deadline ]; then
        echo "---- last lines of $LOG ----" >&2
        tail -n 30 "$LOG" >&2 || true
        die "sandboxd did not come up on $SOCKET (mode $MODE)" \
            "read the log above ($LOG), fix the cause and run this again"
    fi
    sleep 0.2
done

backend=$(printf '%s' "$caps" | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin).get("backend","?"))')
step "sandboxd is up in $((SECONDS - T0)) s: socket $SOCKET, backend $backend, log $LOG"
cat <<EOF

Try it:
    curl -s --unix-socket $SOCKET -X POST http://localhost/v1/sandboxes \\
         -H 'Content-Type: application/json' -d '{}'
    curl -s --unix-socket $SOCKET -X POST http://localhost/v1/sandboxes/<id>/run \\
         -H 'Content-Type: application/json' -d '{"argv": ["echo", "hi"]}'
More in README.md; stop it with: $(if [ "$MODE" = systemd ]; then echo "systemctl stop sandboxd"; else echo "kill \$(cat $PIDFILE)"; fi)
EOF
