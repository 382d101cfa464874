"""The listen backlog both servers ask for, and what the kernel's ``net.core.somaxconn`` makes of it
(sbx.web.serve.listen_backlog). That a burst of 1,000 connects is taken: tests/integration/test_listen_backlog.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from sbx.web.serve import LISTEN_BACKLOG, listen_backlog


def test_the_backlog_takes_a_burst_of_a_thousand() -> None:
    assert LISTEN_BACKLOG >= 1000


@pytest.mark.parametrize(
    ("somaxconn", "given", "warned"),
    [
        ("4096\n", 4096, False),  # Linux 5.4 and later
        ("65535\n", 4096, False),
        ("128\n", 128, True),  # older kernels: cut, and the operator told how to raise it
        (None, 4096, False),  # unreadable: what was asked for
        ("not a number\n", 4096, False),
    ],
    ids=["default", "higher", "lower", "unreadable", "garbage"],
)
def test_the_kernel_cap_is_applied_and_a_cut_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, somaxconn: str | None, given: int, warned: bool
) -> None:
    path = tmp_path / "somaxconn"
    if somaxconn is not None:
        path.write_text(somaxconn)
    with caplog.at_level(logging.WARNING, logger="sbx.web.serve"):
        assert listen_backlog(4096, path) == given
    messages = [r.getMessage() for r in caplog.records]
    assert bool(messages) == warned
    if warned:
        assert "sysctl -w net.core.somaxconn=4096" in messages[0]
