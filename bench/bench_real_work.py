"""The reference battery: ordinary developer tasks in a sandbox against the same programs on the host.

    sudo .venv/bin/python bench/bench_real_work.py [--rounds 3] [--cpus 1,2] [--only git,find,...]
        [--node-config FILE] [--variant LABEL=FILE ...] [--host-upper ext4|tmpfs] [--priority] [--json PATH]

Two kinds of environment run the same tasks with the same programs (the default image's bash, python3, pip,
gcc, make, git, tar, find, grep, node and npm) on the same inputs:

- **host**: a chroot over an overlay of the installed default image, on the host's kernel (no gVisor), in a
  mount and network namespace of its own (no network, as a sandbox's default), with /proc, the host's /dev
  (bound) and /tmp as a tmpfs, run as uid 1000 (``setpriv``, the image's user ``sandbox`` and its groups)
  with the sandbox's environment (the image's variables, HOME=/sandbox/home). Where the overlay's upper
  (writable) layer lives is ``--host-upper``:

  - ``ext4`` (default): an ext4 file system in a sparse file of the sandbox's ``disk_mb`` on a loop device,
    made by sandboxd's own code (``sbx.backends.layers.WritableLayer``: ``mkfs.ext4 -m 0 -O ^has_journal``,
    mounted nodev,nosuid), so both sides write to the same storage stack and only gVisor differs;
  - ``tmpfs``: a tmpfs (what a host with no disk cost at all would give).

- **sandbox**: a sandbox of a sandboxd this script starts (its own state directory and socket, the installed
  images and agent, ``--node-config`` text added to its configuration), one per ``--cpus`` value; without
  ``--cpus`` one sandbox with the node's default resources (``cpus`` omitted from the create). /tmp is a
  tmpfs there too.

The inputs are made once per run on the host (``pip download`` of 10 pinned pure-Python wheels from PyPI, a
git repository of 5,000 files, a C project of 40 files, a generated 1,200-line C file, 300 CommonJS modules,
the Node.js scripts and the battery's own bash script), packed in one tar and unpacked, untimed, in
``/sandbox/home/bench`` of every environment by the environment's own ``tar`` as the sandbox user (into the
sandbox by ``PUT /v1/sandboxes/{id}/files`` of the tar, then a run of ``tar -x``).

Each task runs as ``bash bench/battery.sh <task>``: in a new empty directory ``/sandbox/home/w-<task>``, the
task's commands are timed inside the environment, in the battery's shell, from bash's ``$EPOCHREALTIME``
before them to ``$EPOCHREALTIME`` after them (the clock ``date +%s%N`` reads, without the fork and exec of
``date`` inside the timed span: that costs milliseconds in a sandbox). No API round trip, no process start of
the battery script and no clean-up is timed. A task counts only when its commands exit 0 and an untimed check
after them proves the work was done (files committed, cloned, installed, compiled program's output right);
otherwise it is FAIL, never timed, and the end of its log is printed. The battery, in this order:

 1. ``python``: ``python3 -c pass``, 20 times;
 2. ``venv``: ``python3 -m venv`` (with pip, from the image's ensurepip) of a new venv;
 3. ``gcc``: ``gcc -O2`` of a generated 1,200-line C file (199 functions, external so all are compiled);
 4. ``git``: ``git init``, 2,000 small files in 20 directories written by a bash loop, ``git add .``,
    ``git commit``, ``git status``, ``git log``;
 5. ``tar``: ``tar -cf`` of /usr/lib/python3.11 into a file, then ``tar -xf`` of it;
 6. ``find``: ``find /usr -type f``, then ``grep -r`` of a string that occurs nowhere over /usr/lib/python3.11;
 7. ``node-fs``: Node.js writes, reads back (checked) and unlinks 3,000 files;
 8. ``npm``: ``npm init -y``, then ``node`` requiring a local module;
 9. ``pip``: ``pip install --no-index`` of the 10 local wheels into a new ``--target``;
10. ``clone``: ``git clone`` of the local repository of 5,000 files in 50 directories;
11. ``make``: ``make -j$(nproc)`` of the C project (40 files and a header) from clean, out of tree;
12. ``node-require``: a Node.js program whose 300 CommonJS modules (270 files in a tree, 30 packages in
    node_modules) require each other, offline.

Then two micro rows, reported after the battery and not in its geometric mean: ``fork-exec``, 200 fork+exec
of /bin/true from a bash loop; ``syscalls``, ``dd if=/dev/zero of=/dev/null bs=1 count=100000`` (200,000
one-byte reads and writes).

Rounds interleave the environments task by task (host, then each sandbox, the order rotating each round), so
load from elsewhere weighs on every side alike; one warm-up round comes first and is not counted. Printed as
markdown ready for docs/benchmarks.md: the date (UTC), runsc's version and platform (``GET /v1/node``
``runtime``), each sandbox's cpus (and the CPUs its guest sees), the load average at start and end; per task
the p50 of each environment and each sandbox's ratio to the host at p50; last the geometric mean of the
battery's ratios and its worst task. ``--json PATH`` writes every sample (seconds), warm-up included.

``--priority`` gives the measured work the largest CPU weight cgroups allow (``cpu.shares`` 262144 on cgroup
v1, ``cpu.weight`` 10000 on v2), the sandboxes' parent cgroup ``/sandboxd`` and a cgroup of the host side's
own alike (the parent's weight is put back at the end), so that other work on a shared machine weighs
little on either side; it says so in the output.

Publish numbers from a quiet host (load average under 1), or with ``--priority``: the kernel shares a busy
CPU by cgroup and by session (autogroup), so under load the host side (one session of this script) and a
sandbox (sandboxd's cgroup,
shared with any other sandbox) do not get the same share, and ratios move by 2x and more between runs.

Needs root (chroot, loop devices, sandboxd) and scripts/install.sh's default image and agent. Exits 1 when a
task failed anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tarfile
import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_guest import make_git_repo
from bench_sandboxd import bench_node, default_rootfs, pct
from sandboxd_harness import IMAGES_DIR, Sandboxd

from sbx.backends.layers import WritableLayer, mount_overlay
from sbx.images.store import ImageStore

HOME = "/sandbox/home"
BENCH = f"{HOME}/bench"
#: Pure-Python wheels, pinned so every run installs the same code (pytest's dependencies are among them).
WHEELS = ("pytest==9.2.0", "pygments==2.21.0", "click==8.5.1", "iniconfig==2.3.1", "pluggy==1.7.0",
          "packaging==26.4", "idna==3.20", "attrs==26.1.0", "prometheus-client==0.26.0", "dnslib==0.9.26")  # fmt: skip
WHEEL_IMPORTS = "pytest, pygments, click, iniconfig, pluggy, packaging, idna, attr, prometheus_client, dnslib"
NEEDLE = "sbx-bench-needle-7f3a9c01"  # in no file of the Python standard library
GEN_FUNCTIONS = 199  # of 6 lines each, with an include and main: the 1,200-line C file
C_FILES = 40
NODE_MODULES = 300
REQUIRE_CHILDREN = 3  # module i requires modules 3i+1..3i+3


@dataclass(frozen=True)
class Task:
    """One row: ``run`` (bash, timed) runs in a new empty directory in the battery's shell, so it must not
    ``exit``; it fails with a non-zero status (``return 1`` inside loops). ``check`` (bash, not timed, same
    directory and shell, the task's output in ``$LOG``) exits non-zero when the work was not really done."""

    key: str
    label: str
    run: str
    check: str = "true"
    #: A micro row: reported apart from the battery, not in its geometric mean.
    micro: bool = False


TASKS = (
    Task("python", "`python3 -c pass`, 20 times",
         "for ((i = 0; i < 20; i++)); do python3 -c pass || return 1; done"),
    Task("venv", "`python3 -m venv` (with pip)",
         "python3 -m venv venv",
         "test -x venv/bin/pip && venv/bin/python -m pip --version"),
    Task("gcc", "gcc -O2 of a generated 1,200-line C file",
         'gcc -O2 -o gen "$IN/gen.c"',
         '[ "$(./gen)" = "$(cat "$IN/gen.expected")" ]'),
    Task("git", "git: init, 2,000 small files, add, commit, status, log",
         "git init -q repo && cd repo && mkdir d{0..19} &&"
         ' for ((i = 0; i < 2000; i++)); do echo "file $i" > "d$((i % 20))/f$i.txt"; done &&'
         " git add . && git commit -q -m '2,000 files' && git status && git log",
         '[ "$(git -C repo ls-files | wc -l)" -eq 2000 ] && [ -z "$(git -C repo status --porcelain)" ] &&'
         ' [ "$(git -C repo rev-list --count HEAD)" -eq 1 ]'),
    Task("tar", "tar of /usr/lib/python3.11, then extract",
         "tar -cf py.tar -C /usr/lib python3.11 && mkdir x && tar -xf py.tar -C x",
         '[ "$(find x/python3.11 | wc -l)" -eq "$(find /usr/lib/python3.11 | wc -l)" ]'),
    Task("find", "`find /usr -type f` + `grep -r` over the stdlib",
         'find /usr -type f > files.txt && { grep -r -F -e "$NEEDLE" /usr/lib/python3.11; [ $? -eq 1 ]; }',
         '[ "$(wc -l < files.txt)" -gt 10000 ]'),
    Task("node-fs", "Node.js: write, read, unlink 3,000 files",
         'node "$IN/nodefs.js" files',
         '[ -d files ] && [ -z "$(ls -A files)" ] && grep -qx "3000 files" "$LOG"'),
    Task("npm", "`npm init -y` + a require",
         'npm init -y && node -e "console.log(require(process.env.IN + \'/npm/greet\').greet(\'bench\'))"',
         'grep -q \'"name": "w-npm"\' package.json && grep -qx "hello, bench" "$LOG"'),
    Task("pip", "`pip install` of 10 local wheels (pytest, pygments, ...)",
         'python3 -m pip install -q --no-index --find-links "$IN/wheels" --target target $WHEEL_NAMES',
         f"PYTHONPATH=target python3 -c 'import {WHEEL_IMPORTS}'"),
    Task("clone", "`git clone` of a local repository of 5,000 files",
         'git clone -q "$IN/repo" clone',
         '[ "$(git -C clone ls-files | wc -l)" -eq 5000 ] && [ -z "$(git -C clone status --porcelain)" ]'),
    Task("make", f"`make -j$(nproc)` of a C project of {C_FILES} files",
         'make -s -j"$NPROC" -f "$IN/cproj/Makefile" SRC="$IN/cproj"',
         '[ "$(./prog)" = "$(cat "$IN/cproj/expected")" ]'),
    Task("node-require", f"Node.js requiring {NODE_MODULES} CommonJS modules",
         'node "$IN/nodereq/main.js" > out.txt',
         f'[ "$(cat out.txt)" = "{sum(range(NODE_MODULES))}" ]'),
    Task("fork-exec", "200 fork+exec of `/bin/true`",
         "for ((i = 0; i < 200; i++)); do /bin/true || return 1; done", micro=True),
    Task("syscalls", "200,000 syscalls (`dd bs=1 count=100000`)",
         "dd if=/dev/zero of=/dev/null bs=1 count=100000",
         "grep -q '^100000 bytes' \"$LOG\"", micro=True),
)  # fmt: skip
TASK_KEYS = tuple(task.key for task in TASKS)

# The battery's shell. Everything that is not the task's own commands (environment, directory, clean-up,
# checks) stays outside the timed span.
BATTERY_HEAD = r"""#!/bin/bash
# bash battery.sh TASK: one task of bench/bench_real_work.py, printing "TASK<tab>microseconds", or
# "TASK<tab>FAIL" and the end of its log as lines "!<tab>...".
set -u
export HOME=/sandbox/home IN=/sandbox/home/bench NEEDLE=@NEEDLE@ WHEEL_NAMES='@WHEEL_NAMES@'
export GIT_AUTHOR_NAME=bench GIT_AUTHOR_EMAIL=bench@example.invalid
export GIT_COMMITTER_NAME=bench GIT_COMMITTER_EMAIL=bench@example.invalid
export GIT_CONFIG_NOSYSTEM=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
export NPM_CONFIG_UPDATE_NOTIFIER=false NPM_CONFIG_FUND=false NPM_CONFIG_AUDIT=false
NPROC=$(nproc)
"""
BATTERY_TAIL = r"""
key=$1
fn=${key//-/_}
dir=$HOME/w-$key
LOG=$HOME/w-$key.log
rm -rf "$dir" "$LOG"
mkdir -p "$dir" && cd "$dir" || exit 1
start=${EPOCHREALTIME//[!0-9]/}
"run_$fn" >"$LOG" 2>&1
rc=$?
end=${EPOCHREALTIME//[!0-9]/}
if [ "$rc" -eq 0 ]; then
    cd "$dir" && "check_$fn" >>"$LOG" 2>&1
    rc=$?
fi
if [ "$rc" -eq 0 ]; then
    printf '%s\t%s\n' "$key" $((end - start))
else
    printf '%s\tFAIL\n' "$key"
    tail -n 25 "$LOG" | sed 's/^/!\t/'
fi
cd "$HOME" && rm -rf "$dir" "$LOG"
"""


def battery_script() -> str:
    """bench/battery.sh: a run_ and a check_ function per task, then the timing of the one asked for."""
    functions = [
        f"run_{task.key.replace('-', '_')}() {{\n    {task.run}\n}}\n"
        f"check_{task.key.replace('-', '_')}() {{\n    {task.check}\n}}\n"
        for task in TASKS
    ]
    head = BATTERY_HEAD.replace("@NEEDLE@", NEEDLE).replace(
        "@WHEEL_NAMES@", " ".join(w.split("==")[0] for w in WHEELS)
    )
    return head + "".join(functions) + BATTERY_TAIL


def gen_c() -> tuple[str, int]:
    """A 1,200-line C file (an include, GEN_FUNCTIONS functions of 6 lines, a 5-line main printing their
    checksum) and that checksum, computed here so the check proves the compiled program right."""
    lines, total = ["#include <stdio.h>"], 0
    for i in range(GEN_FUNCTIONS):
        lines += [
            f"long f{i}(long x) {{",
            f"    long s = {i};",
            "    for (long k = 0; k < x; k++)",
            f"        s += (k * {i % 7 + 1}) ^ (s >> 3);",
            "    return s % 100003;",
            "}",
        ]
        s = i
        for k in range(10 + i % 5):
            s += (k * (i % 7 + 1)) ^ (s >> 3)
        total += s % 100003
    calls = " + ".join(f"f{i}({10 + i % 5})" for i in range(GEN_FUNCTIONS))
    lines += ["int main(void) {", f"    long t = {calls};", '    printf("%ld\\n", t);', "    return 0;", "}"]
    return "\n".join(lines) + "\n", total


def c_project(directory: Path) -> None:
    """A C project of C_FILES files sharing a header, an out-of-tree Makefile (``SRC`` names the sources)
    and the output its program must print."""
    directory.mkdir()
    (directory / "common.h").write_text(
        "#ifndef COMMON_H\n#define COMMON_H\n#include <stdio.h>\n#include <string.h>\n"
        + "".join(f"long unit{i}(long x);\n" for i in range(C_FILES))
        + "#endif\n"
    )
    total = 0
    for i in range(C_FILES):
        body = [f'#include "common.h"\n\nstatic const char *name = "unit{i}";\n']
        for j in range(20):
            body.append(
                f"static long g{j}(long x) {{\n    long s = 0;\n"
                f"    for (long k = 0; k < x; k++)\n        s += (k * {j + 1}) ^ {i};\n    return s;\n}}\n"
            )
        body.append(
            f"long unit{i}(long x) {{\n    return (long)strlen(name) + "
            + " + ".join(f"g{j}(x)" for j in range(20))
            + ";\n}\n"
        )
        (directory / f"unit{i}.c").write_text("\n".join(body))
        total += len(f"unit{i}") + sum(sum((k * (j + 1)) ^ i for k in range(i)) for j in range(20))
    calls = " + ".join(f"unit{i}({i})" for i in range(C_FILES))
    (directory / "main.c").write_text(
        f'#include "common.h"\n\nint main(void) {{\n    printf("%ld\\n", {calls});\n    return 0;\n}}\n'
    )
    objs = " ".join(f"unit{i}.o" for i in range(C_FILES))
    (directory / "Makefile").write_text(
        "VPATH = $(SRC)\nCFLAGS = -O2 -Wall -I$(SRC)\n\n"
        f"prog: main.o {objs}\n\t$(CC) -o $@ $^\n\n%.o: %.c $(SRC)/common.h\n\t$(CC) $(CFLAGS) -c -o $@ $<\n"
    )
    (directory / "expected").write_text(f"{total}\n")


def node_require_tree(directory: Path) -> None:
    """NODE_MODULES CommonJS modules, module i requiring modules 3i+1..3i+3: every tenth one (i % 10 == 5) a
    package in node_modules (required by name, found by walking up), the rest files under lib/g<i // 30>/.
    Each exports its number plus its children's; main.js prints module 0's, the sum of all numbers."""

    def place(i: int) -> Path:
        if i % 10 == 5:
            return directory / "node_modules" / f"pkg-{i}" / "index.js"
        return directory / "lib" / f"g{i // 30}" / f"m{i}.js"

    for i in range(NODE_MODULES):
        here = place(i)
        here.parent.mkdir(parents=True, exist_ok=True)
        requires = []
        for child in range(
            REQUIRE_CHILDREN * i + 1, min(REQUIRE_CHILDREN * i + REQUIRE_CHILDREN + 1, NODE_MODULES)
        ):
            if child % 10 == 5:
                spec = f"pkg-{child}"
            else:
                relative = os.path.relpath(place(child), here.parent)
                spec = relative if relative.startswith("..") else f"./{relative}"
            requires.append(f"  require({json.dumps(spec)}),")
        here.write_text(
            "'use strict';\n\n"
            f"const children = [\n{chr(10).join(requires)}\n];\n\n"
            f"function describe(value) {{\n  return {{ id: {i}, name: 'module {i}', value }};\n}}\n\n"
            f"const value = {i} + children.reduce((sum, child) => sum + child.value, 0);\n"
            "module.exports = describe(value);\n"
        )
        if i % 10 == 5:
            (here.parent / "package.json").write_text(
                json.dumps({"name": f"pkg-{i}", "version": "1.0.0", "main": "index.js"}) + "\n"
            )
    (directory / "main.js").write_text("'use strict';\nconsole.log(require('./lib/g0/m0.js').value);\n")


NODE_FS = """'use strict';
// node nodefs.js DIR: write, read back and unlink 3,000 small files in DIR (made here).
const fs = require('fs');
const path = require('path');
const dir = process.argv[2];
const count = 3000;
fs.mkdirSync(dir);
for (let i = 0; i < count; i++) {
  fs.writeFileSync(path.join(dir, `f${i}.txt`), `file ${i}\\n`);
}
for (let i = 0; i < count; i++) {
  if (fs.readFileSync(path.join(dir, `f${i}.txt`), 'utf8') !== `file ${i}\\n`) {
    throw new Error(`f${i}.txt does not hold what was written`);
  }
}
for (let i = 0; i < count; i++) {
  fs.unlinkSync(path.join(dir, `f${i}.txt`));
}
console.log(`${count} files`);
"""
GREET = "'use strict';\nexports.greet = (name) => `hello, ${name}`;\n"


def make_inputs(directory: Path) -> None:
    """Every input of the battery in ``directory`` (the environments' /sandbox/home/bench)."""
    directory.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "-d", str(directory / "wheels"), *WHEELS], check=True)  # fmt: skip
    make_git_repo(directory / "repo")
    source, expected = gen_c()
    assert source.count("\n") == 1200, source.count("\n")
    (directory / "gen.c").write_text(source)
    (directory / "gen.expected").write_text(f"{expected}\n")
    c_project(directory / "cproj")
    node_require_tree(directory / "nodereq")
    (directory / "nodefs.js").write_text(NODE_FS)
    (directory / "npm" / "greet").mkdir(parents=True)
    (directory / "npm" / "greet" / "index.js").write_text(GREET)
    (directory / "battery.sh").write_text(battery_script())


def tar_of(directory: Path) -> bytes:
    """``directory`` as an uncompressed tar whose one top entry is ``bench``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(directory, arcname="bench")
    return buffer.getvalue()


@dataclass
class Outcome:
    """What one run of the battery script printed: seconds, or None and the end of the task's log."""

    seconds: float | None
    log: list[str]


def parse(key: str, output: str) -> Outcome:
    """The battery script's answer for task ``key``; an unexpected answer is a FAIL showing all of it."""
    lines = output.splitlines()
    result = [line.split("\t", 1)[1] for line in lines if line.startswith(f"{key}\t")]
    log = [line[2:] for line in lines if line.startswith("!\t")]
    if len(result) == 1 and result[0].isdigit():
        return Outcome(int(result[0]) / 1e6, [])
    return Outcome(None, log or lines[-25:])


class HostSide:
    """The default image's root as a chroot on the host, over an overlay whose upper is on ``upper``
    (``ext4``: sandboxd's own writable layer code; ``tmpfs``), holding the inputs in /sandbox/home/bench."""

    name = "host"

    def __init__(
        self, workdir: Path, image_root: Path, env: dict[str, str], upper: str, disk_mb: int
    ) -> None:
        #: cgroup.procs files the host side's processes join first (``--priority``).
        self.cgroup_procs: list[Path] = []
        self.layer = WritableLayer(workdir)
        self.upper = upper
        self.env = env
        if upper == "ext4":
            asyncio.run(self.layer.create(image_root, disk_mb))
        else:
            self.layer.disk_dir.mkdir(parents=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "nodev,nosuid", "tmpfs", str(self.layer.disk_dir)],
                           check=True)  # fmt: skip
            for name in ("upper", "work"):
                (self.layer.disk_dir / name).mkdir()
            self.layer.rootfs.mkdir()
            mount_overlay(
                image_root, self.layer.disk_dir / "upper", self.layer.disk_dir / "work", self.layer.rootfs
            )
        self.root = self.layer.rootfs

    def put_inputs(self, inputs: bytes) -> None:
        home = self.root / HOME.lstrip("/")
        (home / "bench.tar").write_bytes(inputs)
        os.chown(home / "bench.tar", 1000, 1000)
        self.run_checked(["sh", "-c", f"tar -xf {HOME}/bench.tar -C {HOME} && rm {HOME}/bench.tar"])

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        """``argv`` in the chroot as the sandbox user in HOME, in new mount and network namespaces with
        /proc, /dev and a tmpfs /tmp."""
        env = [f"{k}={v}" for k, v in self.env.items()]
        join = "".join(f"echo $$ > {shlex.quote(str(p))} && " for p in self.cgroup_procs)
        script = join + (
            'mount -t proc proc "$1/proc" && mount --rbind /dev "$1/dev" && '
            'mount -t tmpfs -o nodev,nosuid,mode=1777 tmpfs "$1/tmp" && cd "$1" && shift && '
            "exec chroot . /usr/bin/setpriv --reuid=1000 --regid=1000 --init-groups "
            f'/usr/bin/env -i -C {HOME} "$@"'
        )
        return subprocess.run(
            ["unshare", "--mount", "--net", "--propagation", "private", "sh", "-c", script, "sh",
             str(self.root), *env, *argv],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip

    def run_checked(self, argv: list[str]) -> str:
        done = self.run(argv)
        if done.returncode != 0:
            raise RuntimeError(f"host: {argv} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done.stdout

    def task(self, key: str) -> Outcome:
        done = self.run(["bash", f"{BENCH}/battery.sh", key])
        return parse(key, done.stdout + done.stderr)

    def close(self) -> None:
        asyncio.run(self.layer.remove())  # unmounts the overlay, then the ext4 or tmpfs under it


class SandboxSide:
    """One sandbox of ``server`` (``cpus`` None: the node's default) holding the inputs in HOME/bench."""

    def __init__(self, server: Sandboxd, cpus: int | None, label: str = "") -> None:
        self.server = server
        fields: dict[str, Any] = {"idle_timeout_secs": 3600}  # the other sides' turns are not idleness
        if cpus is not None:
            fields["cpus"] = cpus
        self.record = server.create(**fields)
        self.id = self.record["id"]
        self.name = (
            (f"{label}, " if label else "")
            + f"cpus {self.record['cpus']}"
            + (" (default)" if cpus is None else "")
        )

    def put_inputs(self, inputs: bytes) -> None:
        put = self.server.request(
            "PUT", f"/v1/sandboxes/{self.id}/files?path={HOME}/bench.tar", body=inputs, timeout=600
        )
        if put.status != 204:
            raise RuntimeError(f"{self.name}: upload answered {put.status}: {put.body!r}")
        self.run_checked(["sh", "-c", f"tar -xf {HOME}/bench.tar -C {HOME} && rm {HOME}/bench.tar"])

    def run(self, argv: list[str]) -> tuple[int, str]:
        resp = self.server.request(
            "POST", f"/v1/sandboxes/{self.id}/run", {"argv": argv, "timeout_secs": 900}, timeout=960
        )
        if resp.status != 200:
            raise RuntimeError(f"{self.name}: run answered {resp.status}: {resp.body!r}")
        result = resp.json()
        out = base64.b64decode(result["stdout"]).decode(errors="replace")
        err = base64.b64decode(result["stderr"]).decode(errors="replace")
        return int(result["exit_code"]), out + err

    def run_checked(self, argv: list[str]) -> str:
        code, out = self.run(argv)
        if code != 0:
            raise RuntimeError(f"{self.name}: {argv} exited {code}: {out}")
        return out

    def task(self, key: str) -> Outcome:
        return parse(key, self.run(["bash", f"{BENCH}/battery.sh", key])[1])


Side = HostSide | SandboxSide


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def report(
    tasks: list[Task], sides: list[Side], samples: dict[str, dict[str, list[float]]],
    failures: dict[str, dict[str, list[str]]],
) -> list[str]:  # fmt: skip
    """The markdown tables: battery (then its geometric mean and worst task), then the micro rows."""
    sandboxes = [s.name for s in sides if s.name != "host"]

    def p50(side: str, key: str) -> float | None:
        if key in failures[side] or not samples[side][key]:
            return None
        return pct(samples[side][key], 50) / 1000

    def cells(task: Task) -> list[str]:
        host = p50("host", task.key)
        row = [task.label, "FAIL" if host is None else fmt_ms(host)]
        for name in sandboxes:
            mine = p50(name, task.key)
            row.append("FAIL" if mine is None else fmt_ms(mine))
            row.append("" if host is None or mine is None else f"{mine / host:.1f}x")
        return row

    header = ["Task", "host"] + [c for name in sandboxes for c in (name, "ratio")]
    out: list[str] = []
    for micro in (False, True):
        group = [t for t in tasks if t.micro == micro]
        if not group:
            continue
        first = "Micro (not in the mean)" if micro else "Task"
        out += ["", "| " + " | ".join([first, *header[1:]]) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(cells(task)) + " |" for task in group]
        if micro:
            continue
        mean_row, worst_row = ["**geometric mean**", ""], ["worst task", ""]
        for name in sandboxes:
            ratios = {}
            for task in group:
                host, mine = p50("host", task.key), p50(name, task.key)
                if host is not None and mine is not None:
                    ratios[task.key] = mine / host
            complete = len(ratios) == len(group)
            mean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios)) if ratios else 0.0
            mean_row += [
                "",
                f"**{mean:.2f}x**" if complete else f"incomplete ({len(group) - len(ratios)} FAIL)",
            ]
            worst = max(ratios, key=lambda k: ratios[k]) if ratios else ""
            worst_row += ["", f"{worst} {ratios[worst]:.1f}x" if worst else ""]
        out += ["| " + " | ".join(mean_row) + " |", "| " + " | ".join(worst_row) + " |"]
    return out


CPU_ROOT = Path("/sys/fs/cgroup")
#: The sandboxes' parent cgroup (sbx.backends.gvisor.CGROUP_PARENT) and the host side's own, for --priority.
SANDBOX_PARENT, HOST_CGROUP = "sandboxd", "sbx-bench-real-work-host"


def raise_priority(stack: ExitStack, host: HostSide) -> str:
    """Give /sandboxd and a cgroup of the host side's own the largest CPU weight; what was done, for the
    output. The parent's previous weight is put back when ``stack`` closes."""
    v2 = (CPU_ROOT / "cgroup.controllers").exists()
    base, knob, top = (CPU_ROOT, "cpu.weight", "10000") if v2 else (CPU_ROOT / "cpu", "cpu.shares", "262144")
    parent, mine = base / SANDBOX_PARENT, base / HOST_CGROUP
    for group in (parent, mine):
        group.mkdir(exist_ok=True)
    before = (parent / knob).read_text().strip()
    stack.callback((parent / knob).write_text, before)
    stack.callback(lambda: mine.rmdir() if mine.exists() else None)
    for group in (parent, mine):
        (group / knob).write_text(top)
    host.cgroup_procs = [mine / "cgroup.procs"]
    return f"{knob} {top} for /{SANDBOX_PARENT} and for the host side"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds, after one warm-up (default 3)")
    parser.add_argument(
        "--cpus", default="", help="one sandbox per value, e.g. 1,2 (default: the node's default)"
    )
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(TASK_KEYS)}")
    parser.add_argument("--node-config", type=Path, help="extra sandboxd configuration (TOML text) to add")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=FILE",
        help="one more sandboxd with FILE's configuration added, its sandboxes named LABEL",
    )
    parser.add_argument("--priority", action="store_true",
                        help="the largest CPU weight for the sandboxes' and the host side's cgroups")  # fmt: skip
    parser.add_argument("--host-upper", choices=("ext4", "tmpfs"), default="ext4",
                        help="where the host chroot's writes go (default ext4, like a sandbox's layer)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every sample (seconds) and failure here")
    args = parser.parse_args()
    only = [k for k in args.only.split(",") if k]
    unknown = sorted(set(only) - set(TASK_KEYS))
    if unknown:
        parser.error(f"unknown tasks {', '.join(unknown)}; known: {', '.join(TASK_KEYS)}")
    tasks = [t for t in TASKS if not only or t.key in only]
    cpus_list: list[int | None] = [int(c) for c in args.cpus.split(",") if c] or [None]
    node_config = args.node_config.read_text() if args.node_config else ""
    variants: list[tuple[str, str]] = []
    for spec in args.variant:
        label, sep, file = spec.partition("=")
        if not sep or not label or not file:
            parser.error(f"--variant {spec!r}: expected LABEL=FILE")
        variants.append((label, node_config + "\n" + Path(file).read_text()))
    load_start = load_average()
    started = time.gmtime()

    with ExitStack() as stack:
        server, work = stack.enter_context(bench_node("sbx-bench-real-work-", node_config))
        runtime = server.request("GET", "/v1/node").json()["runtime"]
        make_inputs(work / "inputs")
        inputs = tar_of(work / "inputs")
        sandboxes = [SandboxSide(server, cpus, "base" if variants else "") for cpus in cpus_list]
        for label, text in variants:
            other, _ = stack.enter_context(bench_node(f"sbx-bench-real-work-{label}-", text))
            sandboxes += [SandboxSide(other, cpus, label) for cpus in cpus_list]
        image = ImageStore(IMAGES_DIR).get("default")
        assert image is not None
        env = {**image.config.env, "HOME": HOME, "USER": "sandbox", "LOGNAME": "sandbox"}
        host = HostSide(work / "host", default_rootfs(), env, args.host_upper, sandboxes[0].record["disk_mb"])
        stack.callback(host.close)
        priority = raise_priority(stack, host) if args.priority else "none"
        sides: list[Side] = [host, *sandboxes]
        nproc = {}
        for side in sides:
            side.put_inputs(inputs)
            nproc[side.name] = side.run_checked(["nproc"]).strip()

        rounds = f"{args.rounds} round{'s' * (args.rounds != 1)}"
        described = "; ".join(
            f"{s.name}: guest sees {nproc[s.name]} CPUs, {s.record['memory_mb']} MiB, disk {s.record['disk_mb']} MiB"
            for s in sandboxes
        )
        print(
            f"## Real developer work against the host (`bench/bench_real_work.py`)\n\n"
            f"    sudo .venv/bin/python bench/bench_real_work.py {shlex.join(sys.argv[1:])}\n\n"
            f"{time.strftime('%Y-%m-%d %H:%M', started)} UTC, runsc {runtime['runsc_version']} on "
            f"{runtime['platform']}, host kernel {platform.release()}, {os.cpu_count()} cores; p50 of {rounds} "
            f"after 1 warm-up, interleaved task by task; host: chroot over an overlay of the default image, upper "
            f"on {args.host_upper}; sandboxes ({described}); CPU priority: {priority}; load average (1, 5, 15 min) "
            f"at start {load_start}.",
            flush=True,
        )

        samples: dict[str, dict[str, list[float]]] = {s.name: defaultdict(list) for s in sides}
        warmup: dict[str, dict[str, float]] = {s.name: {} for s in sides}
        failures: dict[str, dict[str, list[str]]] = {s.name: {} for s in sides}
        for round_number in range(args.rounds + 1):  # round 0 warms caches and is not counted
            shift = round_number % len(sides)
            for task in tasks:
                for side in sides[shift:] + sides[:shift]:
                    outcome = side.task(task.key)
                    if outcome.seconds is None:
                        failures[side.name].setdefault(task.key, outcome.log)
                    elif round_number == 0:
                        warmup[side.name][task.key] = outcome.seconds
                    else:
                        samples[side.name][task.key].append(outcome.seconds)
        load_end = load_average()
        print("\n".join(report(tasks, sides, samples, failures)))
        print(f"\nLoad average (1, 5, 15 min) at end {load_end}.")
        for side_name, failed in failures.items():
            for key, log in failed.items():
                print(
                    f"\nFAIL: {key} on {side_name}; the end of its log:\n"
                    + "\n".join(f"    {x}" for x in log)
                )
        if args.json:
            args.json.write_text(json.dumps({
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", started), "runtime": runtime,
                "host_upper": args.host_upper, "rounds": args.rounds, "load_start": load_start,
                "load_end": load_end,
                "sandboxes": {s.name: {**s.record, "nproc": nproc[s.name]} for s in sandboxes},
                "samples": samples, "warmup": warmup, "failures": failures,
            }, indent=1) + "\n")  # fmt: skip
    if any(failures.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
