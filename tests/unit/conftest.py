"""Fixtures shared by unit tests: the private PostgreSQL cluster (started once per session, when a test asks)."""

from pg_cluster import pg_cluster_fixture

__all__ = ["pg_cluster_fixture"]
