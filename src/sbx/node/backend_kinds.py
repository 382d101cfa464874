"""Which backend sandboxd runs: ``[backend] kind`` in the config names one of :data:`KINDS`.

A kind is a factory from the node's configuration and state directory to a :class:`~sbx.backends.base.Backend`;
its module is imported only when that kind is chosen. A second backend (QEMU) adds itself here; tests add a
fake one with :func:`register`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sbx.backends.base import Backend

if TYPE_CHECKING:
    from sbx.node.config import NodeConfig

#: A backend factory: (configuration, sandboxd's state directory) -> an unchecked, unstarted backend.
Factory = Callable[["NodeConfig", Path], Backend]


def _gvisor(config: NodeConfig, state_dir: Path) -> Backend:
    from sbx.backends.gvisor import GVisorBackend

    return GVisorBackend(
        state_dir,
        config.paths.agent_path,
        platform=config.gvisor.platform,
        runsc=str(config.paths.runsc),
        dentry_cache=config.gvisor.dentry_cache,
        usr_erofs=config.gvisor.usr_erofs,
        root_overlay=config.gvisor.root_overlay,
        pooled_disk_mb=config.defaults.disk_mb,
        egress=config.egress,
    )


#: Backend kinds by name; the default is ``gvisor``.
KINDS: dict[str, Factory] = {"gvisor": _gvisor}
DEFAULT_KIND = "gvisor"


def register(kind: str, factory: Factory) -> None:
    """Make ``kind`` a value ``[backend] kind`` accepts (replacing one of the same name)."""
    KINDS[kind] = factory


def make_backend(config: NodeConfig, state_dir: Path) -> Backend:
    """The backend ``config.backend.kind`` names (the config loader has checked that it is known)."""
    return KINDS[config.backend.kind](config, state_dir)
