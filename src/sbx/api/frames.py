"""The ``sbx-stream/1`` framing of an attached process, shared by the server and the SDK.

After ``GET .../processes/{pid}/attach`` has answered ``101 Switching Protocols``, both sides send
frames: one type byte, a big-endian uint32 payload length, then the payload::

    +------+----------------+-----------------+
    | type | length (>I, 4) | payload (length) |
    +------+----------------+-----------------+

Client to server: ``i`` stdin bytes, ``e`` end of input (no payload; a terminal gets ^D),
``s`` a signal name (``INT``, ``TERM``, ``KILL`` or ``HUP``, ASCII), ``r`` a resize (rows, cols:
two big-endian uint16). Server to client: ``o`` stdout bytes, ``E`` stderr bytes, ``x`` the exit
(a big-endian int32 exit code, the last frame).

The same frames travel over a WebSocket (capability ``websocket_attach``, ``GET .../attach/websocket``):
subprotocol ``WEBSOCKET_PROTOCOL``, each binary message holding one or more whole frames, both ways
(:func:`decode_message`). A browser, which cannot set ``Authorization`` on a WebSocket, offers its credential as
a second subprotocol ``bearer.<token>`` (and a gateway organisation as ``org.<name>``); the server answers with
``WEBSOCKET_PROTOCOL`` alone, never echoing the token.

A payload is at most ``MAX_PAYLOAD_BYTES`` (1 MiB): large enough that a sender never needs more
per frame (it splits bigger writes), small enough that a receiver never buffers more than that
for one frame before it can act. A larger declared length is refused as soon as its header has
arrived, without waiting for the payload.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from sbx.api.errors import InvalidRequest

STDIN: Final = b"i"
END_OF_INPUT: Final = b"e"
SIGNAL: Final = b"s"
RESIZE: Final = b"r"
STDOUT: Final = b"o"
STDERR: Final = b"E"
EXIT: Final = b"x"

#: Types a client sends; a server decodes with ``FrameDecoder(CLIENT_TYPES)``.
CLIENT_TYPES: Final = frozenset({STDIN, END_OF_INPUT, SIGNAL, RESIZE})
#: Types a server sends; a client decodes with ``FrameDecoder(SERVER_TYPES)``.
SERVER_TYPES: Final = frozenset({STDOUT, STDERR, EXIT})

#: Signal names a ``s`` frame may carry.
SIGNALS: Final = ("INT", "TERM", "KILL", "HUP")

#: Largest payload of one frame, in bytes (1 MiB).
MAX_PAYLOAD_BYTES: Final = 1 << 20

#: The upgrade token of the attach stream.
PROTOCOL: Final = "sbx-stream/1"

#: The WebSocket subprotocol of the attach stream's WebSocket form (a token: no ``/``).
WEBSOCKET_PROTOCOL: Final = "sbx-stream.v1"
#: Prefix of the offered subprotocol that carries the bearer token (``bearer.sgk_...``).
WEBSOCKET_BEARER_PREFIX: Final = "bearer."
#: Prefix of the offered subprotocol that carries the gateway organisation (``org.rocket``), as X-Sandbox-Org.
WEBSOCKET_ORG_PREFIX: Final = "org."

_HEADER: Final = struct.Struct(">cI")
HEADER_BYTES: Final = _HEADER.size
_RESIZE: Final = struct.Struct(">HH")
_EXIT: Final = struct.Struct(">i")


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame: its type byte (e.g. ``b"o"``) and payload."""

    type: bytes
    payload: bytes


def encode_frame(type: bytes, payload: bytes = b"") -> bytes:
    """The wire bytes of one frame. Raises ``InvalidRequest`` for a type that is not one byte or a
    payload over ``MAX_PAYLOAD_BYTES`` (split big data with ``encode_chunks``)."""
    if len(type) != 1:
        raise InvalidRequest(f"a frame type is one byte, not {type!r}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise InvalidRequest(
            f"a frame payload is at most {MAX_PAYLOAD_BYTES} bytes, not {len(payload)}: split the data"
        )
    return _HEADER.pack(type, len(payload)) + payload


def encode_chunks(type: bytes, data: bytes) -> bytes:
    """``data`` as as many ``type`` frames as it needs (at least one, so empty data is one frame)."""
    if not data:
        return encode_frame(type, b"")
    view = memoryview(data)
    return b"".join(
        encode_frame(type, bytes(view[start : start + MAX_PAYLOAD_BYTES]))
        for start in range(0, len(data), MAX_PAYLOAD_BYTES)
    )


class FrameDecoder:
    """Turns a byte stream into frames, however it is split: ``feed`` whatever arrived and get the
    frames it completed; an incomplete frame waits in the buffer for the next ``feed``.

    ``types`` restricts the accepted type bytes (``None``: any). ``max_payload_bytes`` defaults to
    ``MAX_PAYLOAD_BYTES``. A frame of another type or a longer declared payload raises
    ``InvalidRequest``; the stream cannot be resynchronised after that, so close the connection.
    """

    def __init__(
        self, types: Iterable[bytes] | None = None, max_payload_bytes: int = MAX_PAYLOAD_BYTES
    ) -> None:
        self._types = frozenset(types) if types is not None else None
        self._max = max_payload_bytes
        self._buffer = bytearray()

    @property
    def pending_bytes(self) -> int:
        """Bytes received but not yet part of a complete frame (0 at a frame boundary)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        """Add ``data`` and return the frames now complete, in order."""
        self._buffer += data
        frames: list[Frame] = []
        offset = 0
        buffer = self._buffer
        while len(buffer) - offset >= HEADER_BYTES:
            type_byte, length = _HEADER.unpack_from(buffer, offset)
            if self._types is not None and type_byte not in self._types:
                raise InvalidRequest(
                    f"unexpected frame type {type_byte!r}: expected one of "
                    + ", ".join(repr(t) for t in sorted(self._types))
                )
            if length > self._max:
                raise InvalidRequest(
                    f"frame {type_byte!r} declares {length} payload bytes; the limit is {self._max}"
                )
            end = offset + HEADER_BYTES + length
            if end > len(buffer):
                break
            frames.append(Frame(type_byte, bytes(buffer[offset + HEADER_BYTES : end])))
            offset = end
        if offset:
            del buffer[:offset]
        return frames


def decode_message(data: bytes, types: Iterable[bytes]) -> list[Frame]:
    """The frames of one WebSocket message, which must hold only whole frames of ``types``; InvalidRequest
    otherwise (a message ending inside a frame, another type, a payload over the limit)."""
    decoder = FrameDecoder(types)
    found = decoder.feed(data)
    if decoder.pending_bytes:
        raise InvalidRequest(
            f"a WebSocket message holds whole frames: it ended {decoder.pending_bytes} bytes into a frame"
        )
    return found


def encode_resize(rows: int, cols: int) -> bytes:
    """The payload of an ``r`` frame: rows then cols, uint16 each (1 to 65535)."""
    for name, value in (("rows", rows), ("cols", cols)):
        if not 1 <= value <= 0xFFFF:
            raise InvalidRequest(f"{name} = {value}: a terminal size is 1 to 65535")
    return _RESIZE.pack(rows, cols)


def decode_resize(payload: bytes) -> tuple[int, int]:
    """``(rows, cols)`` from an ``r`` payload; 4 bytes, neither zero."""
    if len(payload) != _RESIZE.size:
        raise InvalidRequest(f"a resize frame carries 4 bytes (rows, cols), not {len(payload)}")
    rows, cols = _RESIZE.unpack(payload)
    if rows == 0 or cols == 0:
        raise InvalidRequest(f"resize to {rows}x{cols}: rows and cols are at least 1")
    return int(rows), int(cols)


def encode_exit(exit_code: int) -> bytes:
    """The payload of an ``x`` frame: the exit code as an int32 (negative: killed by that signal)."""
    if not -(2**31) <= exit_code < 2**31:
        raise InvalidRequest(f"exit code {exit_code} does not fit an int32")
    return _EXIT.pack(exit_code)


def decode_exit(payload: bytes) -> int:
    """The exit code of an ``x`` payload (4 bytes)."""
    if len(payload) != _EXIT.size:
        raise InvalidRequest(f"an exit frame carries a 4-byte exit code, not {len(payload)} bytes")
    return int(_EXIT.unpack(payload)[0])


def encode_signal(name: str) -> bytes:
    """The payload of an ``s`` frame; ``name`` is one of ``SIGNALS`` (a ``SIG`` prefix is dropped)."""
    bare = name.upper().removeprefix("SIG")
    if bare not in SIGNALS:
        raise InvalidRequest(f"signal {name!r} is not one of {', '.join(SIGNALS)}")
    return bare.encode("ascii")


def decode_signal(payload: bytes) -> str:
    """The signal name of an ``s`` payload, one of ``SIGNALS``."""
    name = payload.decode("ascii", errors="replace")
    if name not in SIGNALS:
        raise InvalidRequest(f"signal {name!r} is not one of {', '.join(SIGNALS)}")
    return name


def resize_frame(rows: int, cols: int) -> bytes:
    """A whole ``r`` frame."""
    return encode_frame(RESIZE, encode_resize(rows, cols))


def exit_frame(exit_code: int) -> bytes:
    """A whole ``x`` frame."""
    return encode_frame(EXIT, encode_exit(exit_code))


def signal_frame(name: str) -> bytes:
    """A whole ``s`` frame."""
    return encode_frame(SIGNAL, encode_signal(name))
