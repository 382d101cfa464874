"""What keeps a tool answer small enough for an agent's context: caps on text, and a window of process output.

Every byte field of an answer (a command's stdout and stderr, a process's output, a file's content) is cut at
the session's cap (``--max-output-bytes``, default :data:`DEFAULT_MAX_OUTPUT_BYTES`) and the cut is reported,
never silent. A run's output keeps its head and its tail (an error is usually at the end, the command's
context at the start); paged output (a process's, a file's) keeps the first bytes from the asked offset and
says where to go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Default cap of one text field of a tool answer, in bytes (per stream for output): about 8k tokens.
DEFAULT_MAX_OUTPUT_BYTES = 32 * 1024
#: The largest cap an operator may set, in bytes (a host's context is the limit, not the server's memory).
MAX_OUTPUT_BYTES_CEILING = 1024 * 1024
#: Bytes of a background process's output kept per stream while nobody reads them (the oldest go first).
PROCESS_WINDOW_BYTES = 1024 * 1024


def utf8_boundary(data: bytes, cut: int) -> int:
    """The largest index ``<= cut`` that does not split a UTF-8 sequence of ``data`` (at most 3 bytes back;
    ``cut`` itself for bytes that are not UTF-8)."""
    if cut >= len(data):
        return len(data)
    cut = max(cut, 0)
    back = cut
    # data[cut] is the first byte left out: a continuation byte (0b10xxxxxx) there splits a sequence.
    while back > 0 and cut - back < 3 and data[back] & 0xC0 == 0x80:
        back -= 1
    return back if data[back] & 0xC0 != 0x80 else cut


def utf8_start(data: bytes, start: int) -> int:
    """The smallest index ``>= start`` that does not begin inside a UTF-8 sequence (at most 3 bytes on)."""
    start = max(0, min(start, len(data)))
    ahead = start
    while ahead < len(data) and ahead - start < 3 and (data[ahead] & 0xC0) == 0x80:
        ahead += 1
    return ahead


def as_text(data: bytes) -> str:
    """Bytes as text: UTF-8, an invalid sequence shown as U+FFFD (output is for reading, not for copying)."""
    return data.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Capped:
    """Text cut to a cap: ``text``, whether anything was left out, and how many bytes were."""

    text: str
    truncated: bool
    omitted_bytes: int


def head_and_tail(data: bytes, limit: int) -> Capped:
    """``data`` as text of at most ``limit`` bytes of it: the whole, or its first and last halves with a
    marker line between them that says how many bytes were left out (the marker is not counted)."""
    if len(data) <= limit:
        return Capped(as_text(data), False, 0)
    head_end = utf8_boundary(data, limit // 2)
    tail_start = utf8_start(data, len(data) - (limit - limit // 2))
    omitted = tail_start - head_end
    marker = f"\n[... {omitted} bytes omitted: the output cap is {limit} bytes per stream ...]\n"
    return Capped(as_text(data[:head_end]) + marker + as_text(data[tail_start:]), True, omitted)


@dataclass(frozen=True)
class Page:
    """Bytes read from an offset: the bytes, the offset after them, and whether more follow already."""

    data: bytes
    next_offset: int
    more: bool


def page(data: bytes, offset: int, limit: int, *, text: bool) -> Page:
    """The bytes of ``data`` from ``offset``, at most ``limit``; with ``text`` the cut does not split a UTF-8
    sequence (unless that would return nothing)."""
    offset = max(0, min(offset, len(data)))
    end = min(len(data), offset + limit)
    if text and end < len(data):
        boundary = utf8_boundary(data, end)
        end = boundary if boundary > offset else end
    return Page(data[offset:end], end, end < len(data))


@dataclass
class StreamWindow:
    """The last :data:`PROCESS_WINDOW_BYTES` of one output stream, addressed by absolute offsets.

    ``total`` counts every byte ever appended; ``base`` is the offset of the first byte still held.
    """

    capacity: int = PROCESS_WINDOW_BYTES
    base: int = 0
    buffer: bytearray = field(default_factory=bytearray)

    @property
    def total(self) -> int:
        """Bytes appended so far (the offset after the last one)."""
        return self.base + len(self.buffer)

    def append(self, data: bytes) -> None:
        """Add ``data``; the oldest bytes leave once more than ``capacity`` are held."""
        self.buffer += data
        excess = len(self.buffer) - self.capacity
        if excess > 0:
            del self.buffer[:excess]
            self.base += excess

    def read(self, offset: int, limit: int) -> tuple[bytes, int, int, bool]:
        """From absolute ``offset``, at most ``limit`` bytes: ``(data, next_offset, dropped, more)``.

        ``dropped`` counts bytes between ``offset`` and the oldest byte still held (they left the window before
        anyone read them); an offset past the end reads nothing. The cut does not split a UTF-8 sequence.
        """
        start = max(offset, self.base)
        dropped = start - offset if offset < self.base else 0
        got = page(bytes(self.buffer), start - self.base, limit, text=True)
        return got.data, self.base + got.next_offset, dropped, got.more
