"""The guest's listening ports read from /proc/net/tcp and /proc/net/tcp6 (sbx.node.listening)."""

from __future__ import annotations

import pytest

from sbx.node.listening import listening_ports

TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1 0000000000000000
   1: 0100007F:1F42 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 2 1 0000000000000000
   2: 0100007F:1F40 0100007F:A000 01 00000000:00000000 00:00000000 00000000  1000        0 3 1 0000000000000000
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue
   0: 00000000000000000000000000000000:1F41 00000000000000000000000000000000:0000 0A 00000000:00000000
   1: 00000000000000000000000000000000:1F40 00000000000000000000000000000000:0000 0A 00000000:00000000
   2: 0000000000000000000000000000"""


@pytest.mark.parametrize(
    ("tables", "ports"),
    [
        ((TCP,), [8000, 8002]),  # 0.0.0.0 and 127.0.0.1 listeners; the established row is not one
        ((TCP, TCP6), [8000, 8001, 8002]),  # :: listeners too, each port once, a torn last line skipped
        (("",), []),
        (("garbage line\n 0: zz:zz 00:00 0A",), []),
    ],
    ids=["ipv4", "ipv4-and-ipv6", "empty", "garbage"],
)
def test_listening_ports(tables: tuple[str, ...], ports: list[int]) -> None:
    assert listening_ports(tables) == ports
