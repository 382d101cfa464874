"""Build the offline default image ``default``: a Debian bookworm root for coding agents, made by mmdebstrap.

Usage (as root; ``scripts/install.sh`` runs it)::

    python -m sbx.images.default_image [--images-dir DIR] [--mirror URL] [--force]

The recipe: ``mmdebstrap --variant=minbase --include=<INCLUDE> bookworm`` from the Debian mirror (plus
bookworm-updates there, and bookworm-security from the security mirror the machine's apt sources name), so
the image has bash, coreutils, findutils, procps, less, git, curl, ca-certificates, python3 with pip, venv
and headers, gcc, g++ and make (build-essential), xz, unzip, zip, jq, file, patch, openssh-client, and
Node.js with npm, all Debian's. mmdebstrap resolves dependencies with apt (debootstrap cannot: npm's
dependencies name virtual packages). Documentation, manual pages and translations are left out (dpkg
``path-exclude``, kept for packages installed later too), copyright files kept. Then the sandbox user (uid
1000, gid 1000, ``sandbox``, home ``/sandbox/home``, shell ``/bin/bash``), the sandbox mount points (see
:mod:`sbx.images.store`), placeholder ``/etc/resolv.conf``, ``/etc/hosts`` and ``/etc/hostname`` (the host's
must not leak in), no apt caches or package lists (``apt-get update`` first inside a sandbox with network
access), and no ``EXTERNALLY-MANAGED`` marker: the sandbox user's ``pip install`` goes to its own site
directory (it cannot write the system's) instead of being refused. It takes about 70 s and 830 MB
(docs/images.md).

Idempotent: an installed ``default`` whose ``sbx.recipe`` annotation equals :data:`RECIPE_ID` is kept;
otherwise (or with ``--force``) it is rebuilt and replaces the old one atomically. :data:`RECIPE_ID` is a hash
of :data:`RECIPE`, so changing the package list or bumping ``RECIPE["version"]`` (do that whenever the code
below changes what ends up in the root) makes every node rebuild on its next install.

The digest is the store's :func:`~sbx.images.store.tree_digest` of the root (content, not timestamps).

The mirror: ``--mirror``, else ``SANDBOX_DEBIAN_MIRROR``, else the first Debian mirror in the machine's apt
sources, else ``http://deb.debian.org/debian``. The security mirror: the machine's apt source for
``bookworm-security``, if any (none: the image has no security updates beyond the point release; say so in
its annotations). apt's ``Acquire::http::Proxy`` is passed on as ``http_proxy`` when the environment sets
none.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from sbx.api.errors import Internal, InvalidRequest, Refused, SandboxError, Unavailable
from sbx.images.store import SANDBOX_GID, SANDBOX_UID, ImageConfig, ImageStore, InstalledImage

#: Reference of the default image in the store.
DEFAULT_IMAGE = "default"
#: Where the images live unless told otherwise.
DEFAULT_IMAGES_DIR = Path("/var/lib/sandboxd/images")
#: The fallback mirror when the apt sources name none.
DEBIAN_DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: The annotation holding the recipe id the image was built from.
RECIPE_ANNOTATION = "sbx.recipe"

#: Everything that decides the image's content; bump ``version`` when the build code changes.
RECIPE: dict[str, object] = {
    "version": 2,
    "tool": "mmdebstrap",
    "suite": "bookworm",
    "updates": ["bookworm-updates", "bookworm-security"],
    "variant": "minbase",
    "include": [
        "bash", "build-essential", "ca-certificates", "coreutils", "curl", "file", "findutils", "git", "jq",
        "less", "nodejs", "npm", "openssh-client", "patch", "procps", "python3", "python3-dev", "python3-pip",
        "python3-venv", "unzip", "xz-utils", "zip",
    ],
    "dpkg": ["path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
             "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/info/*",
             "path-exclude=/usr/share/locale/*", "path-include=/usr/share/locale/locale.alias"],
    "user": {"name": "sandbox", "uid": SANDBOX_UID, "gid": SANDBOX_GID, "home": "/sandbox/home",
             "shell": "/bin/bash"},
    "pip": "no EXTERNALLY-MANAGED marker",
    "clean": ["apt-caches", "apt-lists"],
}  # fmt: skip
RECIPE_ID = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:16]

#: Where the sandbox user's own programs go: ``pip install`` (user site), ``npm install -g`` (prefix).
USER_PREFIX = "/sandbox/home/.local"

#: How processes run in the default image.
DEFAULT_CONFIG = ImageConfig(
    env={
        "PATH": f"{USER_PREFIX}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "NPM_CONFIG_PREFIX": USER_PREFIX,
    },
    working_dir="/sandbox/home",
    user=f"{SANDBOX_UID}:{SANDBOX_GID}",
)

# Suites whose presence in an apt source marks it as a Debian archive (not security, updates or a vendor).
_DEBIAN_SUITES = (
    "bookworm",
    "bullseye",
    "trixie",
    "forky",
    "sid",
    "stable",
    "oldstable",
    "testing",
    "unstable",
)
_TAIL_LINES = 30


def ensure_default_image(
    store: ImageStore, mirror: str, *, security: str | None = None, force: bool = False, progress: bool = True
) -> tuple[InstalledImage, bool]:
    """Install ``default`` unless it is installed from the current recipe; returns (image, built).

    ``security``: the mirror of bookworm-security (None: none). ``progress`` streams mmdebstrap's output
    to stderr.
    """
    current = installed_default(store)
    if current is not None and not force and is_current(current):
        return current, False
    image = store.install_rootfs(
        DEFAULT_IMAGE,
        lambda rootfs: build_rootfs(rootfs, mirror, security=security, progress=progress),
        config=DEFAULT_CONFIG,
        annotations={
            RECIPE_ANNOTATION: RECIPE_ID, "sbx.suite": str(RECIPE["suite"]), "sbx.mirror": mirror,
            "sbx.security_mirror": security or "none",
        },
        replace=True,
    )  # fmt: skip
    return image, True


def installed_default(store: ImageStore) -> InstalledImage | None:
    """The installed default image; None when absent or damaged (a build then replaces it)."""
    try:
        return store.get(DEFAULT_IMAGE)
    except Internal as exc:
        print(f"rebuilding the damaged default image: {exc.message}", file=sys.stderr)
        return None


def is_current(image: InstalledImage) -> bool:
    """Whether ``image`` was built from this module's recipe."""
    return image.annotations.get(RECIPE_ANNOTATION) == RECIPE_ID


def apt_source_lines(mirror: str, security: str | None) -> list[str]:
    """The image's apt sources, one-line format: the suite and its updates from ``mirror``, security
    updates from ``security`` when given."""
    suite = str(RECIPE["suite"])
    lines = [f"deb {mirror} {suite} main", f"deb {mirror} {suite}-updates main"]
    if security is not None:
        lines.append(f"deb {security} {suite}-security main")
    return lines


def build_rootfs(rootfs: Path, mirror: str, *, security: str | None = None, progress: bool = True) -> None:
    """Fill the empty directory ``rootfs`` with the default image's root (needs root and mmdebstrap)."""
    if shutil.which("mmdebstrap") is None:
        raise Unavailable("mmdebstrap is not installed; run scripts/install.sh or apt-get install mmdebstrap")
    include = ",".join(_strings(RECIPE["include"]))
    dpkg_options = [f"--dpkgopt={option}" for option in _strings(RECIPE["dpkg"])]
    _run(
        ["mmdebstrap", "--mode=root", f"--variant={RECIPE['variant']}", f"--include={include}",
         *dpkg_options, str(RECIPE["suite"]), str(rootfs), *apt_source_lines(mirror, security)],
        what=f"mmdebstrap from {mirror}",
        hint="check that the mirror is reachable (or pass --mirror URL) and that the disk has 3 GB free",
        progress=progress,
        env=_env_with_apt_proxy(),
    )  # fmt: skip
    _add_sandbox_user(rootfs)
    _replace_host_files(rootfs)
    _let_pip_install(rootfs)
    _clean_apt(rootfs)


def _let_pip_install(rootfs: Path) -> None:
    # Debian marks its python as managed by apt (PEP 668), so `pip install x` is refused even for the user's
    # own site directory. In a sandbox the user cannot write the system's packages anyway.
    for marker in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()


def _add_sandbox_user(rootfs: Path) -> None:
    # groupadd/useradd --root chroot into the image, so the image's own passwd, shadow and login.defs are
    # edited with the usual locking and formats.
    _run(["groupadd", "--root", str(rootfs), "--gid", str(SANDBOX_GID), "sandbox"], what="groupadd")
    _run(
        ["useradd", "--root", str(rootfs), "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID),
         "--home-dir", "/sandbox/home", "--no-create-home", "--shell", "/bin/bash", "sandbox"],
        what="useradd",
    )  # fmt: skip
    home = rootfs / "sandbox" / "home"
    home.mkdir(parents=True, exist_ok=True)
    os.chmod(rootfs / "sandbox", 0o755)
    skel = rootfs / "etc" / "skel"
    if skel.is_dir() and not skel.is_symlink():
        shutil.copytree(skel, home, symlinks=True, dirs_exist_ok=True)
    for path in [home, *home.rglob("*")]:
        os.chown(path, SANDBOX_UID, SANDBOX_GID, follow_symlinks=False)
    os.chmod(home, 0o755)


def _replace_host_files(rootfs: Path) -> None:
    # mmdebstrap copies the host's resolv.conf and hostname; a sandbox must not learn them. The files stay
    # as mount points for whatever sets up a sandbox's network.
    etc = rootfs / "etc"
    (etc / "resolv.conf").unlink(missing_ok=True)
    (etc / "resolv.conf").write_text(
        "# name servers are provided by sandboxd when the network policy allows\n"
    )
    (etc / "hostname").unlink(missing_ok=True)
    (etc / "hostname").write_text("sandbox\n")
    if not (etc / "hosts").exists():
        (etc / "hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")


def _clean_apt(rootfs: Path) -> None:
    for pattern in ("var/cache/apt/*.bin", "var/cache/apt/archives/*.deb", "var/lib/apt/lists/*"):
        for path in rootfs.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                if path.name != "partial":
                    shutil.rmtree(path)
            else:
                path.unlink()


def _env_with_apt_proxy() -> dict[str, str]:
    env = dict(os.environ)
    proxy = apt_http_proxy()
    if proxy and not env.get("http_proxy"):
        env["http_proxy"] = proxy
    return env


def _run(
    argv: Sequence[str],
    *,
    what: str,
    hint: str = "",
    progress: bool = False,
    env: dict[str, str] | None = None,
) -> None:
    """Run a tool; on failure raise Unavailable with the tail of its output and ``hint``."""
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    with subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
        errors="replace",
    ) as proc:  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if progress:
                print(f"    {line.rstrip()}", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        output = "\n".join(tail)
        raise Unavailable(f"{what} failed (exit {proc.returncode}); {hint}\n{output}".rstrip())


def apt_http_proxy() -> str | None:
    """apt's configured HTTP proxy (``Acquire::http::Proxy``), or None."""
    if shutil.which("apt-config") is None:
        return None
    result = subprocess.run(
        ["apt-config", "shell", "PROXY", "Acquire::http::Proxy"], capture_output=True, text=True, check=False
    )
    # Output is `PROXY='http://host:port/'` when set.
    value = result.stdout.strip().partition("=")[2].strip("'\"")
    return value or None


def security_mirror(apt_dir: Path = Path("/etc/apt")) -> str | None:
    """The first source of the recipe suite's security updates (``bookworm-security``) in the apt sources
    under ``apt_dir``; None when they name none."""
    wanted = f"{RECIPE['suite']}-security"
    return next((uri for uri, suites in _apt_sources(apt_dir) if wanted in suites), None)


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The first Debian archive in the apt sources under ``apt_dir``, else :data:`DEBIAN_DEFAULT_MIRROR`.

    Reads ``sources.list`` and ``sources.list.d/*.list`` (one-line format) and ``*.sources`` (deb822),
    skipping disabled entries, ``deb-src`` and URIs apt cannot fetch from here. A source naming the
    bookworm suite wins over one naming another Debian suite.
    """
    sources = list(_apt_sources(apt_dir))
    for wanted in ((str(RECIPE["suite"]),), _DEBIAN_SUITES):
        for uri, suites in sources:
            if any(s in wanted for s in suites):
                return uri
    return DEBIAN_DEFAULT_MIRROR


def _apt_sources(apt_dir: Path) -> Iterable[tuple[str, list[str]]]:
    """(uri, suites) of every enabled binary source, in apt's reading order."""
    files = [apt_dir / "sources.list"]
    parts = apt_dir / "sources.list.d"
    if parts.is_dir():
        files += sorted(p for p in parts.iterdir() if p.suffix in (".list", ".sources"))
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        entries = _parse_deb822(text) if path.suffix == ".sources" else _parse_one_line(text)
        for uri, suites in entries:
            if urlsplit(uri).scheme in ("http", "https", "file"):
                yield uri.rstrip("/"), suites


def _parse_one_line(text: str) -> Iterable[tuple[str, list[str]]]:
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        if len(words) < 3 or words[0] != "deb":
            continue
        words = words[1:]
        if words[0].startswith("["):
            while words and not words[0].endswith("]"):
                words = words[1:]
            words = words[1:]
        if len(words) >= 2:
            yield words[0], [words[1]]


def _parse_deb822(text: str) -> Iterable[tuple[str, list[str]]]:
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = ""
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0].isspace() and key:
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        suites = fields.get("suites", "").split()
        for uri in fields.get("uris", "").split():
            yield uri, suites


def _strings(value: object) -> list[str]:
    assert isinstance(value, list)
    return [str(v) for v in value]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: build or keep the default image; exit 0 on success, 1 on failure, 2 on bad usage."""
    parser = argparse.ArgumentParser(
        prog="python -m sbx.images.default_image", description="Build the offline default sandbox image."
    )
    parser.add_argument(
        "--images-dir", type=Path, default=Path(os.environ.get("SANDBOX_IMAGES_DIR", DEFAULT_IMAGES_DIR)),
        help=f"image store directory (default: $SANDBOX_IMAGES_DIR or {DEFAULT_IMAGES_DIR})",
    )  # fmt: skip
    parser.add_argument(
        "--mirror", default=os.environ.get("SANDBOX_DEBIAN_MIRROR"),
        help="Debian mirror URL (default: $SANDBOX_DEBIAN_MIRROR, else the apt sources, else deb.debian.org)",
    )  # fmt: skip
    parser.add_argument("--force", action="store_true", help="rebuild even if installed from this recipe")
    args = parser.parse_args(argv)
    try:
        if os.geteuid() != 0:
            raise Refused("building the default image needs root (mmdebstrap); run it as root")
        mirror = args.mirror or debian_mirror()
        if urlsplit(mirror).scheme not in ("http", "https", "file"):
            raise InvalidRequest(f"--mirror {mirror!r} is not an http, https or file URL")
        security = security_mirror()
        store = ImageStore(args.images_dir)
        store.clean_leftovers()
        current = installed_default(store)
        if current is None or args.force or not is_current(current):
            print(
                f"building image {DEFAULT_IMAGE!r} from {mirror} (mmdebstrap, about a minute or two)",
                flush=True,
            )
        started = time.monotonic()
        image, built = ensure_default_image(store, mirror, security=security, force=args.force)
    except SandboxError as exc:
        print(f"{type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1
    state = f"built in {time.monotonic() - started:.0f} s" if built else "up to date"
    print(
        f"image {DEFAULT_IMAGE!r} {state}: {image.bytes / 1e6:.0f} MB, {image.digest[:19]}, recipe {RECIPE_ID}, "
        f"at {image.path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
