"""Local stdin as an asyncio queue of chunks, read on a daemon thread.

A thread rather than the loop's reader: stdin may be a regular file (which epoll refuses), a pipe
or a terminal, and a blocked read must never keep the program from exiting once the remote
process is done (the thread is a daemon, nothing waits for it). It reads the file descriptor with
``os.read``, not through the buffered object: a daemon thread blocked inside a BufferedReader holds
its lock, and the interpreter aborts at exit when it cannot take that lock.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import BinaryIO

#: Bytes asked of stdin per read.
CHUNK_BYTES = 64 * 1024


def stdin_chunks(stream: BinaryIO) -> asyncio.Queue[bytes]:
    """A queue that receives what ``stream`` yields as it arrives, then ``b""`` at its end.

    Must be called from a running loop; the chunks are put on that loop.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    fd = stream.fileno()

    def pump() -> None:
        while True:
            try:
                chunk = os.read(fd, CHUNK_BYTES)
            except (OSError, ValueError):
                chunk = b""
            try:
                loop.call_soon_threadsafe(queue.put_nowait, chunk or b"")
            except RuntimeError:
                return  # the loop is closed: nobody is listening any more
            if not chunk:
                return

    threading.Thread(target=pump, name="sandbox-cli-stdin", daemon=True).start()
    return queue
