"""The host name of a sandbox's port (docs/ports.md, "Addresses"): ``<port>-<node>-<hex>.<domain>`` for the
sandbox ``sbx_<node>_<hex>``, ``<port>-<hex>.<domain>`` for ``sbx_<hex>``.

A node makes sandbox ids as ``sbx_<16 hex>``, or ``sbx_<node id>_<16 hex>`` with ``--node-id`` (1 to 16 of
``a-z 0-9``: no ``-``, no ``_``). The label is the port (1 to 65535, no leading zero) and the id's parts joined by
``-``: at most 5 + 1 + 16 + 1 + 16 = 39 characters of ``a-z 0-9 -``, one DNS label, so one wildcard certificate
covers every port of every sandbox. Each part is parsed strictly, and the label is rebuilt from the id it names
and compared, so exactly one spelling opens a port (no case, no leading zero, no extra ``-``). A sandbox id of
another shape (none a node makes now) has no port URL. A label begins with a digit, a service's name
(``--services-domain``) with a letter.
"""

from __future__ import annotations

import re

_ID = re.compile(r"sbx_(?:([a-z0-9]{1,16})_)?([0-9a-f]{16})")
_LABEL = re.compile(r"([1-9][0-9]{0,4})-(?:([a-z0-9]{1,16})-)?([0-9a-f]{16})")
MAX_PORT = 65535


def label_for(sandbox_id: str, port: int) -> str | None:
    """The label of ``sandbox_id``'s ``port``; None for an id no label can name."""
    found = _ID.fullmatch(sandbox_id)
    if found is None or not 1 <= port <= MAX_PORT:
        return None
    node, suffix = found.groups()
    return f"{port}-{node}-{suffix}" if node else f"{port}-{suffix}"


def parse_label(label: str) -> tuple[str, int] | None:
    """``(sandbox id, port)`` named by ``label``; None for anything not spelled exactly as :func:`label_for`
    spells it."""
    found = _LABEL.fullmatch(label)
    if found is None:
        return None
    port_text, node, suffix = found.groups()
    port = int(port_text)
    sandbox_id = f"sbx_{node}_{suffix}" if node else f"sbx_{suffix}"
    if label_for(sandbox_id, port) != label:
        return None
    return sandbox_id, port
