"""Tenant quotas: the check a create runs before and after the node makes the sandbox."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sbx.api.errors import Refused

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


def check_quota(gw: Gateway, tenant: str, adding: int, cpus: int, memory_mb: int) -> None:
    """403 when ``adding`` more sandboxes with ``cpus`` and ``memory_mb`` would take ``tenant`` past its quota.

    Sandboxes on lost nodes do not count (spec: Node as seen by the gateway)."""
    quota = gw.store.quotas.get(tenant)
    if quota is None:
        return
    count, used_cpus, used_memory = gw.tenant_usage(tenant)
    problems = []
    if quota.max_sandboxes is not None and count + adding > quota.max_sandboxes:
        problems.append(f"{count + adding} sandboxes of {quota.max_sandboxes}")
    if quota.max_cpus is not None and used_cpus + cpus > quota.max_cpus:
        problems.append(f"{used_cpus + cpus} cpus of {quota.max_cpus}")
    if quota.max_memory_mb is not None and used_memory + memory_mb > quota.max_memory_mb:
        problems.append(f"{used_memory + memory_mb} memory_mb of {quota.max_memory_mb}")
    if problems:
        gw.metrics.refused.labels("quota").inc()
        raise Refused(
            f"over the quota of tenant {tenant or 'default'}: "
            + ", ".join(problems)
            + "; delete sandboxes or ask an admin for a larger quota"
        )
