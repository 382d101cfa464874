"""``sandbox-cli mcp``: a Model Context Protocol server that lets an agent host drive sandboxes (docs/mcp.md).

A client of the SDK: it imports ``sbx.api`` and ``sbx.client`` only (``tests/unit/test_layout.py``).

- ``output``: the caps on what a tool answer carries, and the window a background process's output is kept in;
- ``tools``: every tool's arguments and answer as wire types (their JSON Schemas are generated from them),
  its description, and the pure mapping of arguments to SDK calls;
- ``session``: one MCP session: the SDK client, the session label, the followed processes, the clean-up;
- ``server``: the official ``mcp`` SDK's low-level server bound to the tools, over stdio or streamable HTTP.
"""
