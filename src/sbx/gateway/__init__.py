"""``sandbox-gateway``: one API in front of many ``sandboxd`` nodes, with keys, scopes, tenants, orgs,
ownership, placement, node health, revocation, an audit log and metrics (docs/gateway.md).

Modules: ``state`` (SQLite store and its lock), ``keys`` (API keys and scopes), ``auth`` (the request's
principal, the scope table), ``placement`` (``choose_node``), ``nodes`` (node registry and health poller),
``relay`` (forwarding to nodes, streams and upgrades), ``revocation`` (open requests held to their key),
``orgs``, ``audit``, ``metrics``, ``server`` (the HTTP app), ``main`` (the command line).
"""
