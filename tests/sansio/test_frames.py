"""PackedFrames (a many-frame message's frames, held compactly), the values the
message layer gives out-of-band frames, and the amplification bound: what a
message makes the receiver hold, against its bytes on the wire."""

from __future__ import annotations

import gc
import pickle
import struct
import tracemalloc
from typing import Any

import msgpack
import pytest

from anyio_comm import PackedFrames, RemoteProtocolError
from anyio_comm._sansio.decoder import FrameDecoder
from anyio_comm._sansio.frames import PACK_BELOW, ShortFrame, short_frame
from anyio_comm._sansio.serialization import EXT_OOB, EXT_PICKLE, Serializer
from anyio_comm._sansio.wire import Limits, encode_header, encode_preamble

#: what the frames of one message may hold beside 8 times its wire size: 32 frame
#: objects (a message of at most 32 frames has one per frame, whatever their size)
PER_MESSAGE = 13 * 1024


def packed(frames: list[bytes]) -> PackedFrames:
    short = b"".join(f for f in frames if len(f) < PACK_BELOW)
    own = [memoryview(bytearray(f)) for f in frames if len(f) >= PACK_BELOW]
    return PackedFrames(tuple(map(len, frames)), memoryview(bytearray(short)), own)


FRAMES = [bytes([i]) * n for i, n in enumerate([0, 1, 63, 64, 2, 100, 0, 5])]


# -- PackedFrames as a sequence ---------------------------------------------------


def test_indexing_iteration_and_slices() -> None:
    p = packed(FRAMES)
    assert len(p) == len(FRAMES)
    assert [bytes(f) for f in p] == FRAMES
    assert [bytes(p[i]) for i in range(len(FRAMES))] == FRAMES
    assert [bytes(p[i]) for i in range(-len(FRAMES), 0)] == FRAMES
    assert [bytes(f) for f in p[2:6]] == FRAMES[2:6]
    assert [bytes(f) for f in p[::-2]] == FRAMES[::-2]
    assert type(p[1:]) is list
    assert p.nbytes == sum(map(len, FRAMES))
    assert list(reversed(p)) == FRAMES[::-1]
    assert p.index(FRAMES[5]) == 5 and p.count(b"") == 2
    for bad in (len(FRAMES), -len(FRAMES) - 1):
        with pytest.raises(IndexError):
            p[bad]


def test_views_are_writable_and_share_the_message_buffer() -> None:
    p = packed(FRAMES)
    assert all(not f.readonly and f.format == "B" and f.ndim == 1 for f in p)
    p[2][0] = 0xEE  # a short frame: a new view each time, over the same bytes
    assert p[2][0] == 0xEE and p[1] == b"\x01"
    assert p[3] is p[3] and p[2] is not p[2]  # a long frame's view is kept
    assert p[1].obj is p[4].obj and p[3].obj is not p[1].obj


def test_equality_like_a_list() -> None:
    p = packed(FRAMES)
    assert p == FRAMES and p == tuple(FRAMES) and p == packed(FRAMES)
    assert p == FRAMES  # list.__eq__ gives way to ours
    assert p != [*FRAMES[:-1], b"other"] and p != FRAMES[:-1] and p != [*FRAMES, b""]
    assert p != b"".join(FRAMES) and p != set()
    with pytest.raises(TypeError):
        hash(p)
    assert repr(p) == f"<PackedFrames: {len(FRAMES)} frames, {p.nbytes} bytes>"


@pytest.mark.parametrize(
    ("lengths", "short", "own"),
    [
        ((1, 2), b"\x00", []),  # the packed bytes are too few
        ((1,), b"\x00\x00", []),  # ... too many
        ((64,), b"", []),  # a long frame missing
        ((64,), b"", [memoryview(bytearray(65))]),  # of another length
        ((1,), b"\x00", [memoryview(bytearray(64))]),  # one too many
    ],
)
def test_the_constructor_checks_what_it_is_given(
    lengths: tuple[int, ...], short: bytes, own: list[memoryview]
) -> None:
    with pytest.raises(ValueError, match=r"frame|match"):
        PackedFrames(lengths, memoryview(bytearray(short)), own)


# -- what the message layer makes of out-of-band frames -----------------------------


def oob(index: int) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_OOB, struct.pack("!I", index))


@pytest.mark.parametrize("container", ["list", "packed"])
def test_loads_gives_one_object_per_frame_however_often_it_is_referenced(
    container: str,
) -> None:
    """A message delivered as a PackedFrames gives its out-of-band frames shorter
    than 64 bytes as bytes (a ShortFrame), a list gives every frame's view: one
    object per frame either way."""
    count = 40
    payloads = [bytes([i]) * (i * 3) for i in range(count)]  # 0 to 117 bytes
    body = msgpack.packb([oob(i) for i in range(count)] * 3 + [{"k": oob(5)}])
    frames = [body, *payloads]
    given: Any = (
        [memoryview(bytearray(f)) for f in frames] if container == "list" else packed(frames)
    )
    message = Serializer().loads(given)
    assert message[:count] == payloads and message[-1] == {"k": payloads[5]}
    for i, payload in enumerate(payloads):
        assert message[i] is message[i + count] is message[i + 2 * count]
        if container == "packed" and len(payload) < PACK_BELOW:
            assert type(message[i]) is ShortFrame and isinstance(message[i], bytes)
        else:
            assert type(message[i]) is memoryview and not message[i].readonly
    assert message[-1]["k"] is message[5]
    if container == "packed":
        again = Serializer().loads(packed([msgpack.packb([oob(0), oob(1)]), b"", b"\x07"] * 12))
        assert again[0] is message[0] and again[1] is short_frame(memoryview(b"\x07"))


def same(value: object) -> object:
    return value


class Carrier:
    """Pickled as its buffer, out-of-band; unpickled as the buffer pickle is given."""

    def __init__(self, data: bytearray) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: object) -> tuple[Any, ...]:
        return same, (pickle.PickleBuffer(self.data),)


def test_pickled_objects_get_views_of_short_frames() -> None:
    """Pickle's buffers stay writable views (a numpy array made from one is
    writable), even of short frames in a packed message, one per frame."""
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(Carrier(bytearray(b"abc")), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1
    ref = msgpack.ExtType(EXT_PICKLE, struct.pack("!2I", 32, 33))
    body = msgpack.packb([oob(i) for i in range(32)] + [ref, ref])
    message = Serializer(allow_pickle=True).loads(packed([body, *[b""] * 32, stream, b"abc"]))
    assert message[:32] == [b""] * 32
    assert type(message[32]) is memoryview and message[32] == b"abc"
    assert not message[32].readonly
    assert message[33] is message[32]


def test_a_short_frame_is_refused_as_a_map_key() -> None:
    body = msgpack.packb({oob(0): 1})
    with pytest.raises(RemoteProtocolError, match="memoryview is not allowed for map key"):
        Serializer().loads([memoryview(body), memoryview(b"k")])
    with pytest.raises(RemoteProtocolError, match="ShortFrame is not allowed for map key"):
        Serializer().loads(packed([body, *[b"k"] * 40]))


# -- the bound: under 8 times the wire size, plus a constant per message ------------


def wire(frames: list[bytes]) -> bytes:
    return bytes(encode_header([len(f) for f in frames])) + b"".join(frames)


def held(
    stream: bytes, *, decode: bool, allow_pickle: bool = False, **decoder: Any
) -> tuple[int, int]:
    """What receiving the message ``stream`` holds (its frames, or the message
    decoded from them) once it is delivered, and at the peak on the way, from the
    first header byte on (the decoder and its read-ahead buffer exist before), as
    Python allocated it. It arrives in the reads a socket would give."""
    receiver = FrameDecoder(**decoder)
    receiver.feed(encode_preamble(Limits()))
    assert receiver.next_handshake() is not None
    serializer = Serializer(allow_pickle=allow_pickle)
    source = memoryview(stream)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result: Any = None
        while result is None:
            buffer = receiver.get_buffer()
            n = min(len(buffer), len(source))
            buffer[:n] = source[:n]
            source = source[n:]
            del buffer
            receiver.buffer_updated(n)
            result = receiver.next_message()
        if decode:
            result = serializer.loads(result)
        gc.collect()
        now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not source
    return now - before, peak - before


MAX_FRAMES = Limits().max_frames
SHAPES = {
    # the default frame count of empty frames: 128 KiB, 6.4 MB as frame objects
    "empty": [b""] * MAX_FRAMES,
    "1-byte": [b"x"] * MAX_FRAMES,
    "27-byte": [b"x" * 27] * MAX_FRAMES,
    "63-byte": [b"x" * 63] * MAX_FRAMES,
    # the shortest frames that get frame objects of their own in any message
    "64-byte": [b"x" * 64] * MAX_FRAMES,
    "mixed": [b"x" * n for n in (0, 1, 63, 64, 65, 700)] * (MAX_FRAMES // 6),
    "32-empty": [b""] * 32,  # frame objects, within the per-message constant
    "33-empty": [b""] * 33,
    "1-empty": [b""],
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_frames_hold_under_8_times_their_wire_size(shape: str) -> None:
    stream = wire(SHAPES[shape])
    now, peak = held(stream, decode=False)
    assert now < 8 * len(stream) + PER_MESSAGE, f"{now / len(stream):.1f}x"
    assert peak < 8 * len(stream) + PER_MESSAGE, f"{peak / len(stream):.1f}x"


def references(count: int, size: int) -> list[bytes]:
    """A message of ``count`` out-of-band frames of ``size`` bytes, each referenced
    from the body."""
    return [msgpack.packb([oob(i) for i in range(count)])] + [b"x" * size] * count


MESSAGES = {
    **{f"{size}-byte": references(MAX_FRAMES - 1, size) for size in (0, 1, 2, 63, 64)},
    "31-empty": references(31, 0),
    # one frame referenced again and again: one object
    "one-frame-referenced-often": [msgpack.packb([oob(0)] * 100_000), b"x" * 63],
    # frames the body does not refer to (a receiver ignores them)
    **{f"unreferenced-{n}-byte": [msgpack.packb(None)] + [b"x" * n] * 16_383 for n in (2, 4)},
    "last-referenced": [msgpack.packb(oob(16_382))] + [b"x" * 4] * 16_383,
}


@pytest.mark.parametrize("shape", sorted(MESSAGES))
def test_out_of_band_values_hold_under_8_times_their_wire_size(shape: str) -> None:
    """The message layer: a body of nothing but references to out-of-band frames
    (what the body itself decodes to is the application's, see section 10)."""
    stream = wire(MESSAGES[shape])
    now, peak = held(stream, decode=True)
    assert now < 8 * len(stream) + PER_MESSAGE, f"{now / len(stream):.1f}x"
    assert peak < 8 * len(stream) + PER_MESSAGE, f"{peak / len(stream):.1f}x"


def test_pickled_buffers_hold_under_8_times_their_wire_size() -> None:
    """A pickled object's reference naming one short frame again and again (4
    bytes each) gives that frame's view each time, not a new view."""
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(Carrier(bytearray(b"ab")), protocol=5, buffer_callback=buffers.append)
    ref = msgpack.ExtType(EXT_PICKLE, struct.pack("!I", 0) + struct.pack("!I", 1) * 100_000)
    frames = [msgpack.packb([ref]), stream, b"ab", *[b""] * 40]
    wire_bytes = wire(frames)
    now, peak = held(wire_bytes, decode=True, allow_pickle=True)
    assert now < 8 * len(wire_bytes) + PER_MESSAGE, f"{now / len(wire_bytes):.1f}x"
    assert peak < 8 * len(wire_bytes) + PER_MESSAGE, f"{peak / len(wire_bytes):.1f}x"


def test_short_compressed_frames_are_packed_too() -> None:
    """A peer may compress frames far shorter than a sender would: decompressed,
    a short one joins the others in the packed buffer."""
    cramjam = pytest.importorskip("cramjam")
    data = bytes(63)
    out = bytearray(1024)
    compressed = bytes(out[: cramjam.lz4.compress_block_into(data, out, store_size=False)])
    frame = struct.pack("!Q", len(compressed)) + compressed  # 19 bytes for 63
    count = MAX_FRAMES
    stream = (
        struct.pack("!I", count)
        + struct.pack(f"!{count}Q", *[(1 << 56) | len(data)] * count)
        + frame * count
    )
    now, peak = held(stream, decode=False, compression=("lz4",))
    assert now < 8 * len(stream) + PER_MESSAGE, f"{now / len(stream):.1f}x"
    assert peak < 8 * len(stream) + PER_MESSAGE, f"{peak / len(stream):.1f}x"
