"""`sandbox-cli shell` driven through a real pseudo-terminal: type, resize, read the screen, exit."""

from __future__ import annotations

import os
import pty
import signal
import sys
import time
from typing import Any

from pty_screen import read_until, set_size
from sandboxd_harness import Sandboxd


def test_shell_types_resizes_and_exits(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    pid, master = pty.fork()
    if pid == 0:  # the child: sandbox-cli on the pty's slave side, sized before it starts
        set_size(0, 33, 101)
        os.execv(sys.executable, [sys.executable, "-m", "sbx.cli.main", "--url", f"unix://{sandboxd.socket_path}",
                                  "shell", sandbox["id"]])  # fmt: skip
    try:
        read_until(master, b"$ ")  # the guest's bash prompt
        os.write(master, b"stty size; echo marker-$((6*7))\r")
        screen = read_until(master, b"marker-42")
        assert b"33 101" in screen
        set_size(master, 45, 132)
        os.kill(
            pid, signal.SIGWINCH
        )  # the terminal driver does this for a real window; the CLI sends a resize
        time.sleep(0.5)
        os.write(master, b"stty size\r")
        assert b"45 132" in read_until(master, b"45 132")
        os.write(master, b"exit 5\r")
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 5
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(master)
