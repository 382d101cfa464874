"""The node's image service: what ``/v1/images`` and creates need on top of the image store.

- **Names.** A reference is normalised as Docker does (``python:3.12`` is ``docker.io/library/python:3.12``);
  the default image (``[defaults] image``, ``default`` unless configured) and any other image installed
  under a local name are used as they are spelled.
- **Policy.** ``[images] allowed`` decides which registry references may be installed or run (403
  ``refused``); the default image is always allowed.
- **Installs** run in the background, one per reference: a second request (a POST or a create) joins the one
  running. While it runs the image is ``installing`` with ``progress``; a failure is kept as ``failed`` with
  its ``error`` until the image is installed or removed, or sandboxd restarts. An installed image asked for
  again re-checks its tag against the registry and replaces itself when the tag moved, unless a sandbox
  runs from it (the re-check then fails, naming them, and the installed image stays usable).
- **Removal** refuses (409) the default image, a pooled one, one being installed, and one any live sandbox
  (starting or running) uses: its root is the lower layer of their file systems. Cached layers go once no
  installed image records them.

Usage counts come from the sandbox manager and the pools through the ``users`` callable, so this module
needs neither.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC
from typing import Literal

from msgspec import UNSET

from sbx.api.errors import Conflict, Internal, InvalidRequest, NotFound, Refused, SandboxError
from sbx.api.images import Image, ImageProgress, ImageRemoved
from sbx.images.blobs import collect_unused_blobs
from sbx.images.pull import blob_store, pull_image
from sbx.images.reference import normalize_reference, parse_reference
from sbx.images.registry import Credentials, RegistryClient
from sbx.images.store import ImageStore, InstalledImage
from sbx.node.config import NodeConfig, image_pattern_matches

log = logging.getLogger(__name__)


@dataclass
class _Install:
    """One install or re-check running in the background."""

    task: asyncio.Task[InstalledImage]
    phase: Literal["pulling", "building"] = "pulling"
    done_bytes: int = 0
    total_bytes: int = 0


class ImageService:
    """Installs, lists and removes the node's images; all methods run on the server's event loop.

    ``users(reference)`` counts the users' live sandboxes (starting or running) whose root is that image
    (the Image ``in_use``; pooled sandboxes are not counted there).
    ``before_replace(reference)`` is awaited before a moved tag replaces an installed image (the pools drop
    their sandboxes of it), ``after_install(reference)`` after any install ends (the pools refill).
    """

    def __init__(self, config: NodeConfig, store: ImageStore) -> None:
        self.config = config
        self.store = store
        self.users: Callable[[str], int] = lambda reference: 0
        self.before_replace: Callable[[str], Awaitable[None]] = _nothing
        self.after_install: Callable[[str], None] = lambda reference: None
        self._installs: dict[str, _Install] = {}
        self._failed: dict[str, str] = {}
        self._removing: set[str] = set()

    # -- names and policy -------------------------------------------------------------------------------

    @property
    def default_image(self) -> str:
        return self.config.defaults.image

    @property
    def pooled(self) -> frozenset[str]:
        """References with a pool of size above 0."""
        return frozenset(p.image for p in self.config.pools if p.size > 0)

    def canonical(self, text: str) -> str:
        """The name ``text`` is installed under: itself for the default image or another local name
        already installed so, otherwise the normalised reference (InvalidRequest when it is not one)."""
        if text == self.default_image:
            return text
        try:
            return normalize_reference(text)
        except InvalidRequest:
            if self._installed(text) is not None:
                return text
            raise

    def check_allowed(self, reference: str) -> None:
        """Refused unless ``[images] allowed`` permits ``reference`` (a canonical name)."""
        if reference == self.default_image or self._is_local(reference):
            return
        if not any(image_pattern_matches(p, reference) for p in self.config.images.allowed):
            raise Refused(
                f"image {reference} is not allowed on this node; [images] allowed permits: "
                + (", ".join(self.config.images.allowed) or "no registry images")
            )

    def _is_local(self, reference: str) -> bool:
        """Installed under a name that is no registry reference (built on the node, e.g. ``default``)."""
        try:
            return normalize_reference(reference) != reference
        except InvalidRequest:
            return True

    def _installed(self, reference: str) -> InstalledImage | None:
        try:
            return self.store.get(reference)
        except InvalidRequest:
            return None

    # -- installing ---------------------------------------------------------------------------------------

    def install(self, text: str) -> Image:
        """Start (or join) the install of ``text``; returns its Image body (POST /v1/images)."""
        reference = self.canonical(text)
        self.check_allowed(reference)
        if reference not in self._installs:
            if self._is_local(reference):
                # Nothing to fetch: a local image is built on the node (scripts/install.sh for the default).
                if self._installed(reference) is None:
                    raise NotFound(
                        f"image {reference!r} is built on the node, not pulled, and is not installed; "
                        "run scripts/install.sh to build the default image"
                    )
                return self.describe(reference)
            if reference in self._removing:
                raise Conflict(f"image {reference} is being removed; try again in a moment")
            self._start(reference)
        return self.describe(reference)

    def _start(self, reference: str) -> _Install:
        job: _Install

        def progress(phase: str, done: int, total: int) -> None:
            job.phase = "building" if phase == "building" else "pulling"
            job.done_bytes, job.total_bytes = done, total

        task = asyncio.get_running_loop().create_task(self._run(reference, progress))
        job = _Install(task)
        self._installs[reference] = job
        self._failed.pop(reference, None)
        task.add_done_callback(lambda t: self._finished(reference, t))
        return job

    async def _run(self, reference: str, progress: Callable[[str, int, int], None]) -> InstalledImage:
        images = self.config.images
        installed = self._installed(reference)
        if installed is not None:
            moved = await self._tag_moved(reference, installed)
            if not moved:
                return installed
            users = self.users(reference)
            if users:
                raise Conflict(
                    f"the tag of {reference} moved in the registry, but {users} sandbox(es) here run from the "
                    f"installed {installed.digest}; delete them and install again to update it"
                )
            # Pooled sandboxes are nobody's yet: they go, and the pool refills from the new image.
            await self.before_replace(reference)
        return await pull_image(
            self.store,
            reference,
            credentials_file=images.credentials_file,
            insecure_registries=images.insecure_registries,
            allow_private_registries=images.allow_private_registries,
            progress=progress,
            replace=True,
        )

    async def _tag_moved(self, reference: str, installed: InstalledImage) -> bool:
        ref = parse_reference(reference)
        if ref.digest is not None:
            return False  # a digest never moves
        images = self.config.images
        credentials = Credentials.from_file(images.credentials_file) if images.credentials_file else None
        async with RegistryClient(
            credentials=credentials,
            insecure_registries=images.insecure_registries,
            allow_private_registries=images.allow_private_registries,
        ) as c:
            return await c.manifest_digest(ref) != installed.digest

    def _finished(self, reference: str, task: asyncio.Task[InstalledImage]) -> None:
        self._installs.pop(reference, None)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            self._failed.pop(reference, None)
        else:
            message = exc.message if isinstance(exc, SandboxError) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, SandboxError):
                log.error("image install failed unexpectedly", exc_info=exc, extra={"image": reference})
            self._failed[reference] = message
            log.warning("image install failed", extra={"image": reference, "error": message})
        self.after_install(reference)

    async def ensure(self, text: str) -> InstalledImage:
        """The installed image ``text`` names, installing it first when needed (a create waits for it).

        Joins an install or re-check already running. Errors: InvalidRequest (bad reference, or not found
        in the registry), Refused (policy, or the registry refused access), Unavailable (registry down or
        no disk space), Conflict (being removed).
        """
        reference = self.canonical(text)
        self.check_allowed(reference)
        while True:
            job = self._installs.get(reference)
            if job is None:
                if reference in self._removing:
                    raise Conflict(f"image {reference} is being removed; create again once it is gone")
                installed = self._installed(reference)
                if installed is not None:
                    return installed
                if self._is_local(reference):
                    raise InvalidRequest(
                        f"image {reference!r} is not installed on this node and is no registry reference; "
                        f"installed: {', '.join(sorted(i.reference for i in self.store.list()))}"
                    )
                job = self._start(reference)
            try:
                await asyncio.shield(job.task)
            except Exception:  # noqa: BLE001 - every failure is handled alike, below
                # A failed re-check leaves the installed image as it was, and usable.
                installed = self._installed(reference)
                if installed is not None and reference not in self._removing:
                    return installed
                await self._raise_for(reference, job)
            # Loop: the image may have been removed meanwhile; another install then starts.

    @staticmethod
    async def _raise_for(reference: str, job: _Install) -> None:
        """Turn a failed install into the create's error (see :meth:`ensure`)."""
        try:
            await job.task
        except NotFound as exc:
            raise InvalidRequest(f"image {reference} could not be installed: {exc.message}") from exc
        except SandboxError:
            raise
        except Exception as exc:
            raise Internal(f"image {reference} could not be installed: {exc}") from exc

    # -- reading ------------------------------------------------------------------------------------------

    def describe(self, reference: str) -> Image:
        """The spec's Image object of ``reference`` (installed, installing or failed)."""
        installed = self._installed(reference)
        job = self._installs.get(reference)
        state: Literal["installed", "installing", "failed"]
        if job is not None:
            state = "installing"
        elif reference in self._failed:
            state = "failed"
        else:
            state = "installed" if installed is not None else "failed"
        return Image(
            image=reference,
            state=state,
            digest=installed.digest if installed is not None else UNSET,
            bytes=installed.bytes if installed is not None else 0,
            installed_at=(
                installed.installed_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                if installed is not None
                else UNSET
            ),
            in_use=self.users(reference),
            default=reference == self.default_image,
            pooled=reference in self.pooled,
            progress=ImageProgress(job.phase, job.done_bytes, job.total_bytes) if job is not None else UNSET,
            error=self._failed[reference] if job is None and reference in self._failed else UNSET,
        )

    def list(self) -> list[Image]:
        """Every installed, installing and failed image, by name."""
        names = {i.reference for i in self.store.list()} | set(self._installs) | set(self._failed)
        return [self.describe(name) for name in sorted(names)]

    def installing(self, reference: str) -> bool:
        return reference in self._installs

    # -- removing -----------------------------------------------------------------------------------------

    async def remove(self, text: str) -> ImageRemoved:
        """DELETE /v1/images: ``{image, freed_bytes}``; the checks come before anything changes."""
        reference = self.canonical(text)
        if reference in self._installs:
            raise Conflict(f"image {reference} is being installed; delete it once the install has ended")
        if reference == self.default_image:
            raise Conflict(f"image {reference} is this node's default image ([defaults] image) and stays")
        if reference in self.pooled:
            raise Conflict(
                f"image {reference} has a warm pool ([[pools]] in the config); remove the pool and restart first"
            )
        users = self.users(reference)
        if users:
            raise Conflict(
                f"image {reference} is in use by {users} sandbox(es) starting or running here; delete them first"
            )
        if reference in self._removing:
            raise Conflict(f"image {reference} is already being removed")
        if self._installed(reference) is None:
            if self._failed.pop(reference, None) is not None:
                return ImageRemoved(reference, 0)
            raise NotFound(f"image {reference} is not installed on this node")
        self._removing.add(reference)
        try:
            freed = await asyncio.to_thread(self.store.remove, reference)
            self._failed.pop(reference, None)
            freed += await asyncio.to_thread(
                collect_unused_blobs, self.store, blob_store(self.store.images_dir)
            )
        finally:
            self._removing.discard(reference)
        return ImageRemoved(reference, freed)

    async def close(self) -> None:
        """Cancel running installs (a restart forgets them; the store keeps nothing half done)."""
        for job in list(self._installs.values()):
            job.task.cancel()
        for job in list(self._installs.values()):
            try:
                await job.task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001, S110 - cancelled or failed: over either way
                pass


async def _nothing(reference: str) -> None:
    del reference
