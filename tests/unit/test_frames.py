"""The sbx-stream/1 framing: encoding, incremental decoding however the bytes are split, limits."""

from __future__ import annotations

import struct

import pytest

from sbx.api import frames
from sbx.api.errors import InvalidRequest
from sbx.api.frames import Frame, FrameDecoder, encode_frame

SAMPLE = [
    Frame(b"o", b"hello\n"),
    Frame(b"E", b""),
    Frame(b"o", bytes(range(256))),
    Frame(b"x", frames.encode_exit(-9)),
]
SAMPLE_BYTES = b"".join(encode_frame(f.type, f.payload) for f in SAMPLE)


@pytest.mark.parametrize(
    ("type_", "payload", "wire"),
    [
        (b"i", b"ls\n", b"i\x00\x00\x00\x03ls\n"),
        (b"e", b"", b"e\x00\x00\x00\x00"),
        (b"s", b"INT", b"s\x00\x00\x00\x03INT"),
        (b"r", b"\x00\x18\x00\x50", b"r\x00\x00\x00\x04\x00\x18\x00\x50"),
        (b"x", b"\xff\xff\xff\xff", b"x\x00\x00\x00\x04\xff\xff\xff\xff"),
        (b"o", b"\x00" * 300, b"o\x00\x00\x01\x2c" + b"\x00" * 300),
    ],
)
def test_encode_is_type_big_endian_length_payload(type_: bytes, payload: bytes, wire: bytes) -> None:
    assert encode_frame(type_, payload) == wire
    assert FrameDecoder().feed(wire) == [Frame(type_, payload)]


@pytest.mark.parametrize(
    ("type_", "payload"),
    [(b"", b""), (b"oo", b""), (b"o", b"\x00" * (frames.MAX_PAYLOAD_BYTES + 1))],
)
def test_encode_refuses(type_: bytes, payload: bytes) -> None:
    with pytest.raises(InvalidRequest):
        encode_frame(type_, payload)


def test_largest_payload_round_trips() -> None:
    payload = b"\xab" * frames.MAX_PAYLOAD_BYTES
    assert FrameDecoder().feed(encode_frame(b"o", payload)) == [Frame(b"o", payload)]


@pytest.mark.parametrize("cut", range(len(SAMPLE_BYTES) + 1))
def test_split_at_every_byte_boundary(cut: int) -> None:
    decoder = FrameDecoder(frames.SERVER_TYPES)
    got = decoder.feed(SAMPLE_BYTES[:cut]) + decoder.feed(SAMPLE_BYTES[cut:])
    assert got == SAMPLE
    assert decoder.pending_bytes == 0


def test_one_byte_at_a_time() -> None:
    decoder = FrameDecoder()
    got: list[Frame] = []
    for i in range(len(SAMPLE_BYTES)):
        got += decoder.feed(SAMPLE_BYTES[i : i + 1])
        # A frame is returned exactly when its last byte arrives, never earlier.
        assert len(got) == sum(1 for end in _frame_ends(SAMPLE_BYTES) if end <= i + 1), f"after {i + 1} bytes"
    assert got == SAMPLE


def _frame_ends(data: bytes) -> list[int]:
    ends, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack_from(">I", data, offset + 1)
        offset += 5 + length
        ends.append(offset)
    return ends


def test_partial_reads_keep_pending_bytes() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(b"o\x00\x00") == []
    assert decoder.pending_bytes == 3
    assert decoder.feed(b"\x00\x02a") == []
    assert decoder.feed(b"bo\x00\x00\x00\x00") == [Frame(b"o", b"ab"), Frame(b"o", b"")]
    assert decoder.pending_bytes == 0


def test_oversized_frame_refused_from_its_header_alone() -> None:
    decoder = FrameDecoder(max_payload_bytes=10)
    assert decoder.feed(encode_frame(b"o", b"x" * 10)) == [Frame(b"o", b"x" * 10)]
    # Only the 5 header bytes: the decoder does not wait for 11 payload bytes to refuse.
    with pytest.raises(InvalidRequest, match="11 payload bytes; the limit is 10"):
        decoder.feed(b"o\x00\x00\x00\x0b")


def test_default_limit_refuses_a_huge_declared_length() -> None:
    with pytest.raises(InvalidRequest, match="limit"):
        FrameDecoder().feed(b"o\xff\xff\xff\xff")


@pytest.mark.parametrize(
    ("types", "wire"),
    [
        (frames.SERVER_TYPES, encode_frame(b"i", b"x")),
        (frames.CLIENT_TYPES, encode_frame(b"o", b"x")),
        (frames.CLIENT_TYPES, encode_frame(b"Z", b"")),
    ],
)
def test_unexpected_type_refused(types: frozenset[bytes], wire: bytes) -> None:
    with pytest.raises(InvalidRequest, match="unexpected frame type"):
        FrameDecoder(types).feed(wire)


def test_encode_chunks_splits_big_data() -> None:
    data = bytes(range(256)) * (frames.MAX_PAYLOAD_BYTES // 100)
    got = FrameDecoder().feed(frames.encode_chunks(b"i", data))
    assert all(len(f.payload) <= frames.MAX_PAYLOAD_BYTES for f in got)
    assert len(got) == -(-len(data) // frames.MAX_PAYLOAD_BYTES)
    assert b"".join(f.payload for f in got) == data
    assert FrameDecoder().feed(frames.encode_chunks(b"i", b"")) == [Frame(b"i", b"")]


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (24, 80), (65535, 65535)])
def test_resize_round_trip(rows: int, cols: int) -> None:
    assert frames.decode_resize(frames.encode_resize(rows, cols)) == (rows, cols)
    assert FrameDecoder().feed(frames.resize_frame(rows, cols)) == [
        Frame(b"r", struct.pack(">HH", rows, cols))
    ]


@pytest.mark.parametrize(("rows", "cols"), [(0, 80), (24, 0), (65536, 80), (-1, 1)])
def test_resize_refuses_out_of_range(rows: int, cols: int) -> None:
    with pytest.raises(InvalidRequest):
        frames.encode_resize(rows, cols)


@pytest.mark.parametrize("payload", [b"", b"\x00\x18\x00", b"\x00\x00\x00\x50", b"\x00\x18\x00\x50\x00"])
def test_decode_resize_refuses(payload: bytes) -> None:
    with pytest.raises(InvalidRequest):
        frames.decode_resize(payload)


@pytest.mark.parametrize("code", [0, 1, 255, -1, -9, 2**31 - 1, -(2**31)])
def test_exit_round_trip(code: int) -> None:
    assert frames.decode_exit(frames.encode_exit(code)) == code
    assert FrameDecoder().feed(frames.exit_frame(code)) == [Frame(b"x", struct.pack(">i", code))]


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1])
def test_exit_refuses_out_of_int32(bad: int) -> None:
    with pytest.raises(InvalidRequest):
        frames.encode_exit(bad)
    with pytest.raises(InvalidRequest):
        frames.decode_exit(b"\x00\x00")


@pytest.mark.parametrize(("given", "wire"), [("INT", b"INT"), ("sigterm", b"TERM"), ("KILL", b"KILL")])
def test_signal_payload(given: str, wire: bytes) -> None:
    assert frames.encode_signal(given) == wire
    assert frames.decode_signal(wire) == wire.decode()
    assert frames.signal_frame(given) == encode_frame(b"s", wire)


@pytest.mark.parametrize("bad", ["USR1", "", "9"])
def test_signal_refuses_others(bad: str) -> None:
    with pytest.raises(InvalidRequest, match="INT, TERM, KILL, HUP"):
        frames.encode_signal(bad)
    with pytest.raises(InvalidRequest):
        frames.decode_signal(bad.encode())
