"""Tenant quotas: the check a create runs, under the tenant's lock, before a node makes the sandbox."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sbx.api.errors import Refused

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


class OverQuota(Refused):
    """A create would take the tenant past its quota (403 ``refused`` on the wire; a job's run waits instead)."""


def quota_problem(gw: Gateway, tenant: str, adding: int, cpus: int, memory_mb: int) -> str | None:
    """Why ``adding`` more sandboxes with ``cpus`` and ``memory_mb`` in all would take ``tenant`` past its
    quota (the 403's message), or None when they fit.

    Sandboxes on lost nodes do not count (spec: Node as seen by the gateway)."""
    quota = gw.store.quotas.get(tenant)
    if quota is None:
        return None
    count, used_cpus, used_memory = gw.tenant_usage(tenant)
    problems = []
    if quota.max_sandboxes is not None and count + adding > quota.max_sandboxes:
        problems.append(f"{count + adding} sandboxes of {quota.max_sandboxes}")
    if quota.max_cpus is not None and used_cpus + cpus > quota.max_cpus:
        problems.append(f"{used_cpus + cpus} cpus of {quota.max_cpus}")
    if quota.max_memory_mb is not None and used_memory + memory_mb > quota.max_memory_mb:
        problems.append(f"{used_memory + memory_mb} memory_mb of {quota.max_memory_mb}")
    if not problems:
        return None
    return (
        f"over the quota of tenant {tenant or 'default'}: "
        + ", ".join(problems)
        + "; delete sandboxes or ask an admin for a larger quota"
    )
