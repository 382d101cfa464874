"""Pull an image from a registry into the image store: resolve, fetch layers once, unpack, install.

:func:`pull_image` is the whole job. Steps, and the progress it reports through ``progress(phase, done,
total)``:

1. resolve the reference to this host's manifest and config (:class:`~sbx.images.registry.RegistryClient`);
   an image already installed under the same reference with the same digest is returned as it is;
2. ``("pulling", done, total)``: fetch the layers missing from the blob store, up to
   :data:`PARALLEL_DOWNLOADS` at once; bytes are the compressed layer sizes of the manifest, layers already
   stored count as done from the start;
3. ``("building", done, total)``: unpack the layers in order into a fresh root
   (:mod:`sbx.images.unpack`) and install it atomically (:meth:`ImageStore.install_rootfs`) with the
   image config, the digest and the layer list; bytes are again compressed layer sizes, counted as each
   layer is applied.

Concurrent pulls of one reference into one store in this process are joined: they share the work and all
get its result or its error, and each caller's ``progress`` hears about it. A layer shared by two images is
fetched and stored once (:class:`~sbx.images.blobs.BlobStore`). A failed pull leaves nothing installed and
no partial blob; the blobs it completed stay as cache until :func:`~sbx.images.blobs.collect_unused_blobs`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sbx.api.errors import Internal, SandboxError, Unavailable
from sbx.images.blobs import BlobStore, BlobWriter, SingleFlight
from sbx.images.reference import Reference, parse_reference
from sbx.images.registry import DEFAULT_ATTEMPTS, Credentials, Descriptor, RegistryClient, ResolvedImage
from sbx.images.store import ImageStore, InstalledImage
from sbx.images.unpack import apply_layer

log = logging.getLogger(__name__)

#: Layers downloaded at once by one pull (Docker's default too).
PARALLEL_DOWNLOADS = 3

#: ``progress(phase, done_bytes, total_bytes)``; phase is ``"pulling"`` or ``"building"``.
ProgressCallback = Callable[[str, int, int], None]

#: Annotations pull_image adds to image.json besides the manifest's own.
ANNOTATION_PLATFORM = "sbx.platform"
ANNOTATION_MANIFEST = "sbx.manifest_digest"


@dataclass
class _Listeners:
    """The progress callbacks of every caller joined to one pull, and the last state sent to them."""

    callbacks: list[ProgressCallback] = field(default_factory=list)
    last: tuple[str, int, int] | None = None

    def add(self, callback: ProgressCallback | None) -> None:
        if callback is not None:
            self.callbacks.append(callback)
            if self.last is not None:
                self._call(callback, *self.last)

    def emit(self, phase: str, done: int, total: int) -> None:
        self.last = (phase, done, total)
        for callback in list(self.callbacks):
            self._call(callback, phase, done, total)

    @staticmethod
    def _call(callback: ProgressCallback, phase: str, done: int, total: int) -> None:
        try:
            callback(phase, done, total)
        except Exception:  # a broken observer must not fail the pull everyone shares
            log.exception("image pull progress callback failed")


_pulls: SingleFlight[tuple[str, str], InstalledImage] = SingleFlight()
_listeners: dict[tuple[str, str], _Listeners] = {}
_blob_stores: dict[str, BlobStore] = {}


def blob_store(images_dir: Path) -> BlobStore:
    """The process-wide :class:`BlobStore` of ``images_dir`` (one per directory, so fetches are joined)."""
    key = str(Path(images_dir).absolute())
    if key not in _blob_stores:
        _blob_stores[key] = BlobStore(Path(key))
    return _blob_stores[key]


async def pull_image(
    store: ImageStore,
    reference: str,
    *,
    credentials_file: Path | str | None = None,
    insecure_registries: Iterable[str] = (),
    allow_private_registries: Iterable[str] = (),
    progress: ProgressCallback | None = None,
    attempts: int = DEFAULT_ATTEMPTS,
    replace: bool = True,
) -> InstalledImage:
    """Pull ``reference`` into ``store`` and return the installed image.

    The image is installed under the normalised reference (``python:3.12`` is installed as
    ``docker.io/library/python:3.12``) with the registry's manifest digest as its digest (the index's when
    the reference names a multi-platform index) and the image config. ``credentials_file`` is a Docker
    ``config.json``-style file (see :class:`~sbx.images.registry.Credentials`); ``insecure_registries``
    lists ``host[:port]`` allowed over plain HTTP besides loopback; ``allow_private_registries`` the
    ``host[:port]`` that may be on loopback or private addresses (:mod:`sbx.images.addresses`; the registry,
    its token server and any host it redirects to must be); ``attempts`` is how many times each request is
    tried. An image installed under the reference with another digest (the tag moved) is
    replaced when ``replace`` is true (stop its sandboxes first), else Conflict is raised.

    Raises InvalidRequest (bad reference, unusable image), Refused (access denied, or an address the puller
    may not connect to), NotFound (no such image), Unavailable (registry unreachable, out of disk space) or
    Conflict.
    """
    ref = parse_reference(reference)
    key = (str(Path(store.images_dir).absolute()), str(ref))
    found = _listeners.get(key) if _pulls.running(key) else None
    listeners = found or _Listeners()
    _listeners[key] = listeners
    listeners.add(progress)

    async def run() -> InstalledImage:
        try:
            client = RegistryClient(
                credentials=Credentials.from_file(credentials_file) if credentials_file is not None else None,
                insecure_registries=insecure_registries, allow_private_registries=allow_private_registries,
                attempts=attempts,
            )  # fmt: skip
            async with client:
                return await _pull(store, parse_reference(reference), client, replace, listeners)
        finally:
            if _listeners.get(key) is listeners:
                del _listeners[key]

    try:
        return await _pulls.run(key, run)
    finally:
        if progress is not None and progress in listeners.callbacks:
            listeners.callbacks.remove(progress)


async def _pull(
    store: ImageStore, ref: Reference, client: RegistryClient, replace: bool, listeners: _Listeners
) -> InstalledImage:
    resolved = await client.resolve(ref)
    installed = await asyncio.to_thread(store.get, str(ref))
    if installed is not None and installed.digest == resolved.digest:
        log.info("image %s is up to date (%s)", ref, resolved.digest)
        listeners.emit("pulling", resolved.total_layer_bytes, resolved.total_layer_bytes)
        return installed
    blobs = blob_store(store.images_dir)
    digests = [layer.digest for layer in resolved.layers]
    with blobs.pinned(digests):
        paths = await _fetch_layers(client, blobs, resolved, listeners)
        try:
            return await _install(store, resolved, paths, replace, listeners)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise Unavailable(
                    f"no disk space left in {store.images_dir} to install {ref}; remove images or free space"
                ) from exc
            raise Internal(f"installing image {ref} failed: {exc}") from exc


async def _fetch_layers(
    client: RegistryClient, blobs: BlobStore, resolved: ResolvedImage, listeners: _Listeners
) -> list[Path]:
    # Each distinct layer once (an image may list one twice, e.g. an empty layer).
    unique = list({layer.digest: layer for layer in resolved.layers}.values())
    total = sum(layer.size for layer in unique)
    state = {"done": 0}
    semaphore = asyncio.Semaphore(PARALLEL_DOWNLOADS)

    def add(delta: int) -> None:
        state["done"] += delta
        listeners.emit("pulling", state["done"], total)

    async def fetch(layer: Descriptor) -> Path:
        reported = 0

        def on_bytes(delta: int) -> None:
            nonlocal reported
            reported += delta
            add(delta)

        async def fill(writer: BlobWriter) -> None:
            async with semaphore:
                await client.fetch_blob(resolved.reference, layer, writer, on_bytes)

        path = await blobs.ensure(layer.digest, layer.size, fill)
        # A layer already stored, or fetched by a pull this one joined, reported nothing yet.
        add(layer.size - reported)
        return path

    listeners.emit("pulling", 0, total)
    try:
        async with asyncio.TaskGroup() as group:
            tasks = {layer.digest: group.create_task(fetch(layer)) for layer in unique}
    except BaseExceptionGroup as eg:
        raise _first_error(eg) from None
    return [tasks[layer.digest].result() for layer in resolved.layers]


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to report from a failed group: a SandboxError when there is one."""
    flat: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            flat.append(exc)

    walk(group)
    for exc in flat:
        if isinstance(exc, SandboxError):
            return exc
    return flat[0]


async def _install(
    store: ImageStore, resolved: ResolvedImage, paths: Sequence[Path], replace: bool, listeners: _Listeners
) -> InstalledImage:
    loop = asyncio.get_running_loop()
    total = resolved.total_layer_bytes

    def build(rootfs: Path) -> None:
        done = 0
        for layer, path in zip(resolved.layers, paths, strict=True):
            apply_layer(rootfs, path, label=layer.digest)
            done += layer.size
            loop.call_soon_threadsafe(listeners.emit, "building", done, total)

    annotations = dict(resolved.annotations)
    annotations[ANNOTATION_MANIFEST] = resolved.manifest_digest
    if resolved.platform is not None:
        annotations[ANNOTATION_PLATFORM] = str(resolved.platform)
    listeners.emit("building", 0, total)
    image = await asyncio.to_thread(
        store.install_rootfs,
        str(resolved.reference),
        build,
        config=resolved.config,
        digest=resolved.digest,
        annotations=annotations,
        replace=replace,
        layers=[layer.digest for layer in resolved.layers],
    )
    log.info("pulled image %s (%s, %d layers)", resolved.reference, resolved.digest, len(resolved.layers))
    return image
