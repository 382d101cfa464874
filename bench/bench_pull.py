"""Benchmark pulling a multi-layer image from a loopback registry: our pull vs `skopeo copy`, same run.

    sudo .venv/bin/python bench/bench_pull.py [--layers 6] [--layer-mib 16] [--runs 5]

Builds an image of N gzip layers (each LAYER-MIB MiB of files, half of them incompressible), pushes it to
Debian's docker-registry on 127.0.0.1, then times, each from an empty store:
- `skopeo copy docker://... dir:...` (fetch and verify the blobs, nothing unpacked);
- our `pull_image` fetch phase (fetch and verify into the blob store) and the whole install (plus unpacking
  every layer into the image root).
Needs apt packages docker-registry and skopeo (install.sh --test-deps installs them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_sandboxd import pct
from oci_registry import Entry, Registry, build_image, layer, push

from sbx.images.pull import pull_image
from sbx.images.store import ImageStore


def make_layers(count: int, mib: int) -> list[bytes]:
    layers = []
    for i in range(count):
        files = [Entry(f"data{i}", kind="dir")]
        for j in range(mib):
            # Half random (incompressible), half text: a realistic mix for gzip.
            body = os.urandom(512 * 1024) + (b"line of text %d\n" % j) * (512 * 1024 // 16)
            files.append(Entry(f"data{i}/f{j}", body[: 1024 * 1024]))
        layers.append(layer(files))
    return layers


async def our_pull(images_dir: Path, reference: str) -> tuple[float, float]:
    """(seconds until every blob is fetched and verified, seconds for the whole install)."""
    fetched_at: list[float] = []
    started = time.monotonic()

    def progress(phase: str, done: int, total: int) -> None:
        if phase == "building" and not fetched_at:
            fetched_at.append(time.monotonic())

    registry = reference.split("/")[0]  # on loopback: listed, as an operator lists an internal registry
    await pull_image(ImageStore(images_dir), reference, insecure_registries=(registry,),
                     allow_private_registries=(registry,), progress=progress)  # fmt: skip
    finished = time.monotonic()
    return (fetched_at[0] if fetched_at else finished) - started, finished - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--layer-mib", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    for tool in ("docker-registry", "skopeo"):
        if shutil.which(tool) is None:
            sys.exit(f"cannot benchmark: {tool} is missing (apt-get install {tool})")
    workdir = Path(tempfile.mkdtemp(prefix="sbx-bench-pull-", dir="/var/tmp"))
    (workdir / "registry").mkdir()
    registry = Registry(workdir / "registry").start()
    try:
        layers = make_layers(args.layers, args.layer_mib)
        image = build_image(layers, {"Env": ["A=1"]})
        asyncio.run(push(registry.url, "bench/multi", "v1", image))
        total_mib = sum(len(b) for b in layers) / 2**20
        reference = f"{registry.host}/bench/multi:v1"
        print(
            f"# pull of {args.layers} layers, {total_mib:.0f} MiB compressed, {time.strftime('%Y-%m-%d %H:%M')} UTC"
        )
        skopeo, fetch, install = [], [], []
        for i in range(args.runs):
            dest = workdir / f"skopeo-{i}"
            started = time.monotonic()
            subprocess.run(
                [
                    "skopeo",
                    "copy",
                    "--quiet",
                    "--src-tls-verify=false",
                    f"docker://{reference}",
                    f"dir:{dest}",
                ],
                check=True,
            )
            skopeo.append(time.monotonic() - started)
            shutil.rmtree(dest)
            images_dir = workdir / f"store-{i}"
            fetched, whole = asyncio.run(our_pull(images_dir, reference))
            fetch.append(fetched)
            install.append(whole)
            shutil.rmtree(images_dir)
        base = pct(skopeo, 50)
        for name, values in (
            ("skopeo copy (fetch, verify)", skopeo),
            ("our pull, fetch and verify", fetch),
            ("our pull, whole install (+ unpack)", install),
        ):
            print(f"{name:<38} p50 {pct(values, 50):7.0f} ms   p95 {pct(values, 95):7.0f} ms   "
                  f"ratio p50 {pct(values, 50) / base:5.2f}x")  # fmt: skip
    finally:
        registry.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
