"""Tenant quotas: the check a create runs, under the tenant's lock, before a node makes the sandbox, and the one a
request that would wake a persistent sandbox runs before it is passed on (``sbx.gateway.persistent``).

A check reads only :class:`QuotaUsage`: the quotas in the store and what each tenant uses now."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from sbx.api.errors import Refused

if TYPE_CHECKING:
    from sbx.gateway.store import Store


class QuotaUsage(Protocol):
    """What a quota check reads (issue 34): the store (its ``quotas``) and what a tenant uses now. The gateway
    provides it (its ``tenant_usage`` counts the records not on lost nodes); a unit test gives a stand-in."""

    @property
    def store(self) -> Store: ...

    def tenant_usage(self, tenant: str) -> tuple[int, int, int]:
        """(sandboxes, cpus, memory_mb) counted against ``tenant``'s quota."""


class OverQuota(Refused):
    """A create or a wake would take the tenant past its quota (403 ``refused`` on the wire; a job's run waits
    instead)."""


def shortfalls(usage: QuotaUsage, tenant: str, adding: int, cpus: int, memory_mb: int) -> list[str]:
    """What ``adding`` more sandboxes and ``cpus`` and ``memory_mb`` more in all would take past ``tenant``'s
    quota, one phrase per amount (``"3 cpus of 2"``); empty when they fit or the tenant has no quota.

    Sandboxes on lost nodes do not count (spec: Node as seen by the gateway), nor the cpus and memory of a
    persistent sandbox asleep (``QuotaUsage.tenant_usage``)."""
    quota = usage.store.quotas.get(tenant)
    if quota is None:
        return []
    count, used_cpus, used_memory = usage.tenant_usage(tenant)
    problems = []
    # A wake adds no sandbox: it is already counted, so a quota lowered below the count does not keep it asleep.
    if adding and quota.max_sandboxes is not None and count + adding > quota.max_sandboxes:
        problems.append(f"{count + adding} sandboxes of {quota.max_sandboxes}")
    if quota.max_cpus is not None and used_cpus + cpus > quota.max_cpus:
        problems.append(f"{used_cpus + cpus} cpus of {quota.max_cpus}")
    if quota.max_memory_mb is not None and used_memory + memory_mb > quota.max_memory_mb:
        problems.append(f"{used_memory + memory_mb} memory_mb of {quota.max_memory_mb}")
    return problems


def quota_problem(usage: QuotaUsage, tenant: str, adding: int, cpus: int, memory_mb: int) -> str | None:
    """Why ``adding`` more sandboxes with ``cpus`` and ``memory_mb`` in all would take ``tenant`` past its
    quota (the 403's message), or None when they fit."""
    problems = shortfalls(usage, tenant, adding, cpus, memory_mb)
    if not problems:
        return None
    return (
        f"over the quota of tenant {tenant or 'default'}: "
        + ", ".join(problems)
        + "; delete sandboxes or ask an admin for a larger quota"
    )


def wake_problem(usage: QuotaUsage, tenant: str, sandbox_id: str, cpus: int, memory_mb: int) -> str | None:
    """Why waking the persistent sandbox ``sandbox_id`` (asleep, so not counted), which takes ``cpus`` and
    ``memory_mb`` again once awake, would take ``tenant`` past its quota (the 403's message), or None."""
    problems = shortfalls(usage, tenant, 0, cpus, memory_mb)
    if not problems:
        return None
    return (
        f"waking sandbox {sandbox_id} ({cpus} cpus, {memory_mb} memory_mb) would take tenant "
        f"{tenant or 'default'} over its quota: " + ", ".join(problems)
        + "; stop other persistent sandboxes of the tenant, delete some, or ask an admin for a larger quota"
    )  # fmt: skip
