"""The small web toolkit both servers (``sandboxd`` and ``sandbox-gateway``) are built on, over aiohttp.

Modules: ``http`` (JSON answers through the one codec, the error middleware that gives every failure the
spec's error body, body caps and streaming, query parameters), ``guard`` (a node's request guard: Host,
Origin, bearer token), ``upgrade`` (HTTP/1.1 Upgrade to a raw byte stream: the server's takeover after a
101, and the client's handshake), ``serve`` (listening on a private unix socket or TCP with TLS, the loopback
``/metrics`` server, and running an application until a signal, with start-up and shutdown written once as
aiohttp ``cleanup_ctx`` generators), ``logs`` (JSON log lines).

Nothing here knows sandboxes, nodes or keys; ``sbx.node`` and ``sbx.gateway`` import this, never each other.
"""
