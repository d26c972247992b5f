"""FrameDecoder without an event loop: splits, limits, EOF, direct reads."""

from __future__ import annotations

import ctypes
from itertools import accumulate

import pytest

from anyio_comm import BufferPool, Limits, PackedFrames, RemoteProtocolError
from anyio_comm._sansio.decoder import (
    MIN_READ_BUFFER_SIZE,
    PREAMBLE_BUFFER_SIZE,
    EndOfData,
    FrameDecoder,
    ReceiveMode,
    ReceiveStatus,
)
from anyio_comm._sansio.frames import PACK_BELOW
from anyio_comm._sansio.pool import ALIGNMENT
from anyio_comm._sansio.wire import MAGIC, Capability, Handshake, encode_header, encode_preamble

PREAMBLE = encode_preamble(Limits())
PREAMBLE_V1 = encode_preamble(Limits(), version=1)


def encode(*messages: list[bytes]) -> bytes:
    return b"".join(encode_header([len(f) for f in m]) + b"".join(m) for m in messages)


MESSAGES = [[b"hello", b"", b"world!"], [], [b"x" * 300], [b""], [bytes(range(256)) * 9]]
STREAM = PREAMBLE + encode(*MESSAGES)


class Collector:
    """Feeds a decoder and collects what it produces (h11-style harness)."""

    def __init__(self, **kwargs: object) -> None:
        self.decoder = FrameDecoder(**kwargs)  # type: ignore[arg-type]
        self.handshake = None
        self.messages: list[list[bytes]] = []

    def drain(self) -> None:
        if self.handshake is None:
            self.handshake = self.decoder.next_handshake()
            if self.handshake is None:
                return
        while (frames := self.decoder.next_message()) is not None:
            self.messages.append([bytes(f) for f in frames])

    def feed(self, data: bytes) -> None:
        """Write ``data`` through get_buffer/buffer_updated, draining as a comm does."""
        view = memoryview(data)
        while view:
            buf = self.decoder.get_buffer()
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            self.decoder.buffer_updated(n)
            view = view[n:]
            self.drain()


def test_one_byte_at_a_time() -> None:
    c = Collector()
    for i in range(len(STREAM)):
        c.feed(STREAM[i : i + 1])
    assert c.handshake is not None
    assert c.handshake.limits == Limits()
    assert c.messages == MESSAGES


@pytest.mark.parametrize("split", range(len(STREAM) + 1))
def test_every_split_offset(split: int) -> None:
    c = Collector()
    c.feed(STREAM[:split])
    c.feed(STREAM[split:])
    assert c.messages == MESSAGES


def test_trailing_partial_message_is_kept() -> None:
    c = Collector()
    full = encode([b"abc"])
    c.feed(PREAMBLE + full + full[:5])
    assert c.messages == [[b"abc"]]
    assert not c.decoder.at_message_boundary
    c.feed(full[5:])
    assert c.messages == [[b"abc"], [b"abc"]]
    assert c.decoder.at_message_boundary


def test_next_message_returns_at_most_one_message() -> None:
    d = FrameDecoder()
    d.feed(PREAMBLE + encode([b"a"], [b"b"]))
    assert d.next_handshake() is not None
    assert [bytes(f) for f in d.next_message() or []] == [b"a"]
    assert [bytes(f) for f in d.next_message() or []] == [b"b"]
    assert d.next_message() is None


def test_large_frame_is_received_directly_into_its_buffer() -> None:
    d = FrameDecoder(read_buffer_size=4096)
    payload = bytes(range(256)) * 400  # 100 KiB
    d.feed(PREAMBLE + encode_header([len(payload)]) + payload[:100])
    assert d.next_handshake() is not None
    assert d.next_message() is None
    target = d.get_buffer()
    # the view handed out is the frame's own buffer, not the read-ahead buffer
    assert target.nbytes == len(payload) - 100
    target[:] = payload[100:]
    d.buffer_updated(target.nbytes)
    (frame,) = d.next_message() or []
    assert bytes(frame) == payload
    assert frame.obj is target.obj  # same allocation: the kernel wrote the final place


class Socket:
    """A reader that fills whatever get_buffer hands out from ``stream`` (a socket
    holding all of it), recording each read: the size handed out, and whether it was
    a frame's own buffer (one the allocator made) or the read-ahead buffer."""

    def __init__(self, stream: bytes, **kwargs: object) -> None:
        self.stream = memoryview(stream)
        self.frame_buffers: list[bytearray] = []
        self.decoder = FrameDecoder(allocator=self.allocate, **kwargs)  # type: ignore[arg-type]
        self.decoder.on_handshake = lambda handshake: None
        self.reads: list[tuple[int, bool]] = []
        self.messages: list[list[bytes]] = []

    def allocate(self, nbytes: int) -> bytearray:
        buffer = bytearray(nbytes)
        self.frame_buffers.append(buffer)
        return buffer

    def read(self, limit: int | None = None) -> None:
        """One read of up to ``limit`` bytes, then every message it completed."""
        buffer = self.decoder.get_buffer()
        self.reads.append((buffer.nbytes, any(buffer.obj is f for f in self.frame_buffers)))
        n = min(buffer.nbytes, self.stream.nbytes, buffer.nbytes if limit is None else limit)
        buffer[:n] = self.stream[:n]
        self.stream = self.stream[n:]
        self.decoder.buffer_updated(n)
        while (frames := self.decoder.next_message()) is not None:
            self.messages.append([bytes(f) for f in frames])


def test_after_a_read_into_a_frame_the_next_takes_a_header_and_little_more() -> None:
    """A stream of large messages copies little of each out of the read-ahead buffer:
    after a read straight into a frame's buffer, the next read at the start of a
    message is MIN_READ_BUFFER_SIZE bytes, once; then the read-ahead buffer is
    handed out whole again (a run of small messages is read in full reads)."""
    large = [bytes([i]) * 100_000 for i in range(3)]
    small = [[b"s%d" % i * 30] for i in range(2000)]  # about 70 KB
    messages = [[large[0]], [large[1]], *small, [b"head", large[2]]]
    sock = Socket(PREAMBLE + encode(*messages))
    while sock.stream:
        sock.read()
    assert sock.messages == messages
    full = 64 * 1024
    sizes = [size for size, _ in sock.reads]
    directs = [i for i, (_, direct) in enumerate(sock.reads) if direct]
    assert sizes[0] == PREAMBLE_BUFFER_SIZE  # (it holds the first header too)
    assert len(directs) == 3  # one read for the rest of each large frame
    # the second large message right after the first: little of it copied
    assert sizes[directs[1] - 1] == MIN_READ_BUFFER_SIZE
    assert sizes[directs[1]] > 100_000 - MIN_READ_BUFFER_SIZE
    after = directs[1] + 1  # the small messages: one short read, then full ones
    assert sizes[after] == MIN_READ_BUFFER_SIZE
    assert all(size > full - 100 for size in sizes[after + 1 : directs[2]])


def test_the_rest_of_a_frame_below_the_direct_size_is_read_ahead_in_full() -> None:
    """A direct read that came up short leaving less than a quarter of the
    read-ahead buffer of the frame: the rest goes through the read-ahead buffer,
    handed out whole (a frame is still open), and that read is the last straight
    into a frame: the reads at the start of the messages after it are whole too."""
    payload = bytes(range(256)) * 400
    small = [[b"m%d" % i * 20] for i in range(400)]  # about 40 KB
    messages = [[payload], *small]
    sock = Socket(PREAMBLE + encode(*messages), read_buffer_size=16 * 1024)
    sock.read()  # the preamble
    sock.read(100)  # the header and 88 bytes of the frame
    sock.read(len(payload) - 2000)  # into the frame, 1,912 bytes short
    assert sock.reads[-1][1]
    sock.read(5000)  # the rest of the frame, and some small messages
    assert sock.reads[-1] == (16 * 1024, False)
    assert sock.messages[0] == [payload]
    while sock.stream:
        sock.read()
    assert sock.messages == messages
    assert all(size > 16 * 1024 - 100 for size, _ in sock.reads[4:-1])


def test_a_many_frame_message_after_a_frame_read_directly_is_read_in_full() -> None:
    """Only a read at the start of a message is short: the rest of a message of many
    short frames after its large first frame is read ahead in full reads."""
    message = [b"L" * 100_000] + [b"s"] * 40 + [b"t" * 3000] * 40
    sock = Socket(PREAMBLE + encode(message, [b"after"]))
    while sock.stream:
        sock.read()
    assert sock.messages == [message, [b"after"]]
    direct = [i for i, (_, into_frame) in enumerate(sock.reads) if into_frame]
    assert len(direct) == 1
    assert all(size > 60_000 for size, _ in sock.reads[direct[0] + 1 :])


def test_a_short_read_after_a_frame_is_still_due_if_abandoned() -> None:
    """The read-ahead buffer handed out after a read straight into a frame stays
    short until a read into it happens (a read that found nothing, and so reported
    nothing, changes nothing); then it is whole again."""
    payload = b"p" * 100_000
    sock = Socket(PREAMBLE + encode([payload], [b"next"], [b"x" * 5000]))
    sock.read()  # the preamble, the header and the frame's first bytes
    sock.read()  # the rest of the frame, directly
    assert sock.reads[-1][1] and sock.messages == [[payload]]
    assert sock.decoder.get_buffer().nbytes == MIN_READ_BUFFER_SIZE  # abandoned
    sock.read(20)
    assert sock.reads[-1] == (MIN_READ_BUFFER_SIZE, False)
    sock.read()
    assert sock.reads[-1][0] > 64 * 1024 - 20
    assert sock.messages == [[payload], [b"next"], [b"x" * 5000]]


@pytest.mark.parametrize("allocating", ["allocator", "pool"])
@pytest.mark.parametrize("before", [[], [b"body"], [b"", b"x" * 3000]])
def test_large_frame_buffer_is_allocated_at_the_next_get_buffer(
    before: list[bytes], allocating: str
) -> None:
    """A frame whose rest will be read directly gets its buffer when the bytes are
    wanted (status TASK_READS_FRAME says so before): the bytes already in the read-ahead
    buffer move into it. So is a last frame after frames whole in the read-ahead
    buffer (a body and a large out-of-band frame), with or without a pool."""
    sizes: list[int] = []

    def allocator(n: int) -> bytearray:
        sizes.append(n)
        return bytearray(n)

    pool = BufferPool()
    if allocating == "pool":
        d = FrameDecoder(read_buffer_size=64 * 1024, allocator=pool)
    else:
        d = FrameDecoder(read_buffer_size=4096, allocator=allocator)
    payload = bytes(range(256)) * 400  # 100 KiB
    lengths = [*map(len, before), len(payload)]
    head = encode_header(lengths)
    d.feed(PREAMBLE + head + b"".join(before) + payload[:1000])
    assert d.next_handshake() is not None
    assert d.state.status is not ReceiveStatus.TASK_READS_FRAME
    assert d.next_message() is None
    assert d.next_message() is None  # asking again changes nothing
    assert d.state.status is ReceiveStatus.TASK_READS_FRAME
    assert len(payload) not in sizes and pool.statistics().buffers_in_use == 0
    assert not d.at_message_boundary
    assert d.received_in_message == len(head) + sum(map(len, before)) + 1000
    target = d.get_buffer()
    assert d.state.status is not ReceiveStatus.TASK_READS_FRAME
    if allocating == "pool":
        assert pool.statistics().buffers_in_use == 1
    else:
        assert sizes[-1] == len(payload)
    assert target.nbytes == len(payload) - 1000
    target[:-1] = payload[1000:-1]
    d.buffer_updated(target.nbytes - 1)
    assert d.next_message() is None  # one byte short
    assert d.received_in_message == len(head) + sum(lengths) - 1
    d.feed(payload[-1:])  # (through the read-ahead buffer: too little to read directly)
    frames = d.next_message()
    assert frames is not None
    assert [bytes(f) for f in frames] == [*before, payload]
    assert d.at_message_boundary and d.received_in_message == 0
    d.feed(encode([b"next"]))
    assert [bytes(f) for f in d.next_message() or []] == [b"next"]


@pytest.mark.parametrize(
    ("limits", "rule"),
    [
        (Limits(max_frame_size=99_999), "max_frame_size"),
        (Limits(max_message_size=100_004), "max_message_size"),
    ],
)
def test_a_large_last_frame_over_the_limits_is_refused_at_its_header(
    limits: Limits, rule: str
) -> None:
    """A message of a body and a large frame that breaks a limit is refused
    before anything is allocated for its large frame."""
    sizes: list[int] = []

    def allocator(n: int) -> bytearray:
        sizes.append(n)
        return bytearray(n)

    d = FrameDecoder(limits, read_buffer_size=4096, allocator=allocator)
    d.feed(PREAMBLE + encode_header([5, 100_000]) + b"body!" + b"x" * 100)
    d.next_handshake()
    with pytest.raises(RemoteProtocolError) as info:
        d.next_message()
    assert info.value.rule == rule
    assert sizes == []


def test_small_frame_buffer_is_allocated_with_its_header() -> None:
    """A frame that will come through the read-ahead buffer needs no announcement."""
    d = FrameDecoder(read_buffer_size=4096)
    d.feed(PREAMBLE + encode_header([800]) + b"x" * 100)
    d.next_handshake()
    assert d.next_message() is None
    assert d.state.status is not ReceiveStatus.TASK_READS_FRAME


@pytest.mark.parametrize("announced", [True, False])
@pytest.mark.parametrize("lengths", [[100_000], [7, 100_000]])
def test_end_of_stream_while_a_frame_buffer_is_due(lengths: list[int], announced: bool) -> None:
    """The stream ends after the header of a message whose large frame is due,
    before or after that frame was announced: the next call raises it."""
    d = FrameDecoder(read_buffer_size=4096)
    d.feed(PREAMBLE + encode_header(lengths) + b"x" * (sum(lengths[:-1]) + 10))
    d.next_handshake()
    if announced:
        assert d.next_message() is None and d.state.status is ReceiveStatus.TASK_READS_FRAME
    d.receive_eof()
    with pytest.raises(EndOfData) as info:
        d.next_message()
    assert info.value.truncated
    assert d.state.status is not ReceiveStatus.TASK_READS_FRAME


def test_frames_have_their_own_exact_buffers() -> None:
    d = FrameDecoder()
    d.feed(PREAMBLE + encode([b"ab", b"cde"]))
    d.next_handshake()
    a, b = d.next_message() or []
    assert a.obj is not b.obj
    assert len(a.obj) == 2 and len(b.obj) == 3  # type: ignore[arg-type]
    assert not a.readonly


def test_custom_allocator_is_used_for_every_frame() -> None:
    sizes: list[int] = []

    def allocator(n: int) -> bytearray:
        sizes.append(n)
        return bytearray(n)

    c = Collector(allocator=allocator)
    c.feed(STREAM)
    assert c.messages == MESSAGES
    assert sizes == [len(f) for m in MESSAGES for f in m]


@pytest.mark.parametrize(
    "bad",
    [lambda n: b"x" * n, lambda n: bytearray(n + 1), lambda n: memoryview(bytearray(2 * n))[::2]],
)
def test_bad_allocator_is_rejected(bad: object) -> None:
    c = Collector(allocator=bad)
    with pytest.raises(TypeError, match="allocator"):
        c.feed(PREAMBLE + encode([b"abc"]))


@pytest.mark.parametrize(
    ("limits", "message", "match"),
    [
        (Limits(max_frames=2), [b"", b"", b""], "3 frames"),
        (Limits(max_frame_size=10), [b"x" * 11], "frame of 11 bytes"),
        (Limits(max_message_size=10), [b"x" * 6, b"y" * 6], "message of 12 bytes"),
    ],
)
def test_limits_are_enforced_on_the_header(
    limits: Limits, message: list[bytes], match: str
) -> None:
    allocated: list[int] = []

    def allocator(n: int) -> bytearray:
        allocated.append(n)
        return bytearray(n)

    d = FrameDecoder(limits, allocator=allocator)
    d.feed(PREAMBLE)
    d.next_handshake()
    header = encode_header([len(f) for f in message])
    d.feed(header)  # the header alone must be enough to reject
    with pytest.raises(RemoteProtocolError, match=match):
        d.next_message()
    assert allocated == []


def test_huge_lengths_rejected_before_allocation() -> None:
    d = FrameDecoder()
    d.feed(PREAMBLE + (1).to_bytes(4, "big") + (2**64 - 1).to_bytes(8, "big"))
    d.next_handshake()
    with pytest.raises(RemoteProtocolError, match="exceeds the limit"):
        d.next_message()


def test_huge_frame_count_rejected_before_reading_lengths() -> None:
    d = FrameDecoder()
    d.feed(PREAMBLE + (2**32 - 1).to_bytes(4, "big"))
    d.next_handshake()
    with pytest.raises(RemoteProtocolError, match="frames; the limit is"):
        d.next_message()


def test_length_table_larger_than_read_buffer() -> None:
    n = 2000  # 16 KB of lengths > 4 KiB read-ahead
    message = [bytes([i % 256]) for i in range(n)]
    c = Collector(read_buffer_size=4096)
    c.feed(PREAMBLE + encode(message))
    assert c.messages == [message]


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x89ACOMX", b"\x00" * 40, b"\x16\x03\x01\x02\x00"],
)
def test_wrong_magic_fails_on_first_bad_byte(garbage: bytes) -> None:
    d = FrameDecoder()
    d.feed(garbage)
    with pytest.raises(RemoteProtocolError, match="does not speak"):
        d.next_handshake()


@pytest.mark.parametrize(
    ("garbage", "hint"),
    [
        (b"\x16\x03\x01\x00\xdc\x01\x00\x00\xd8\x03\x03", True),  # a ClientHello
        (b"\x15\x03\x01\x00\x02\x02\x46", True),  # a fatal alert
        (b"\x15\x03", True),
        (b"\x15", False),  # one byte is no evidence
        (b"\x17\x03\x03\x00\x10", False),  # application data: not a TLS peer's first bytes
        (b"\x16\x02\x00", False),
        (b"\x80\x2e\x01\x03\x01", False),  # an SSL 2 hello
        (b"GET / HTTP/1.1\r\n", False),
        (b"\x89ACOMX", False),
    ],
)
def test_tls_hint_only_for_a_tls_record(garbage: bytes, hint: bool) -> None:
    """The error says that the peer speaks TLS only when its bytes begin a TLS alert
    or handshake record (version 3.x)."""
    d = FrameDecoder()
    d.feed(garbage)
    with pytest.raises(RemoteProtocolError, match="does not speak") as caught:
        d.next_handshake()
    assert ("it speaks TLS: use a tls:// address" in str(caught.value)) is hint


def test_magic_prefix_waits_for_more() -> None:
    d = FrameDecoder()
    d.feed(MAGIC[:5])
    assert d.next_handshake() is None


def test_version_zero_rejected_and_newer_version_downgraded() -> None:
    d = FrameDecoder()
    d.feed(MAGIC + b"\x00\x00" + PREAMBLE[10:])
    with pytest.raises(RemoteProtocolError, match="version 0"):
        d.next_handshake()
    # A future version keeps the version-2 body: limits, then capability entries,
    # of which unknown ids (and unknown value bytes of known ones) are skipped.
    body = PREAMBLE_V1[12:] + bytes.fromhex("7f00 0003 616263  0001 0002 ffff")
    d = FrameDecoder()
    d.feed(MAGIC + b"\x00\x07" + len(body).to_bytes(2, "big") + body)
    handshake = d.next_handshake()
    assert handshake == Handshake(2, Limits(), frozenset({Capability.CLOSE_REASONS}))
    # A version-1 side reads the limits and ignores the rest of the body.
    d = FrameDecoder(version=1)
    body = PREAMBLE_V1[12:] + b"future fields"
    d.feed(MAGIC + b"\x00\x07" + len(body).to_bytes(2, "big") + body)
    assert d.next_handshake() == Handshake(1, Limits())


@pytest.mark.parametrize(
    "entries",
    ["00", "0001", "000100", "0001 0001", "0002 0000 0002 0000", "7f00 0000 7f00 0001 00"],
)
def test_malformed_capability_entries_rejected(entries: str) -> None:
    body = PREAMBLE_V1[12:] + bytes.fromhex(entries)
    d = FrameDecoder()
    d.feed(MAGIC + b"\x00\x02" + len(body).to_bytes(2, "big") + body)
    with pytest.raises(RemoteProtocolError, match="capability") as info:
        d.next_handshake()
    assert info.value.rule == "preamble"
    # a version-1 side does not read them
    d = FrameDecoder(version=1)
    d.feed(MAGIC + b"\x00\x02" + len(body).to_bytes(2, "big") + body)
    assert d.next_handshake() == Handshake(1, Limits())


@pytest.mark.parametrize("length", [0, 19, 1025, 65535])
def test_bad_preamble_body_length(length: int) -> None:
    d = FrameDecoder()
    d.feed(MAGIC + b"\x00\x01" + length.to_bytes(2, "big"))
    with pytest.raises(RemoteProtocolError, match="preamble body length"):
        d.next_handshake()


def test_clean_eof_between_messages() -> None:
    d = FrameDecoder()
    d.feed(PREAMBLE + encode([b"a"]))
    d.next_handshake()
    d.receive_eof()
    assert d.next_message() is not None
    with pytest.raises(EndOfData) as info:
        d.next_message()
    assert not info.value.truncated
    with pytest.raises(EndOfData):  # and again
        d.next_message()


@pytest.mark.parametrize("cut", [1, 3, 4, 11, 12, 14])
def test_eof_inside_a_message_is_truncation(cut: int) -> None:
    d = FrameDecoder()
    d.feed(PREAMBLE + encode([b"abc", b"de"])[:cut])
    d.next_handshake()
    d.receive_eof()
    with pytest.raises(EndOfData) as info:
        d.next_message()
    assert info.value.truncated


def test_eof_inside_preamble_is_truncation() -> None:
    d = FrameDecoder()
    d.feed(PREAMBLE[:10])
    d.receive_eof()
    with pytest.raises(EndOfData) as info:
        d.next_handshake()
    assert info.value.truncated


def test_api_misuse() -> None:
    d = FrameDecoder()
    with pytest.raises(RuntimeError, match="next_handshake"):
        d.next_message()
    d.feed(PREAMBLE)
    d.next_handshake()
    with pytest.raises(RuntimeError, match="already"):
        d.next_handshake()
    with pytest.raises(ValueError, match="at least 4096"):
        FrameDecoder(read_buffer_size=100)


def test_feed_refuses_to_overflow() -> None:
    d = FrameDecoder(read_buffer_size=4096)
    with pytest.raises(BufferError):
        d.feed(PREAMBLE + encode(*[[b"x" * 100]] * 100))


@pytest.mark.parametrize(
    ("limits", "lengths", "match"),
    [
        (Limits(max_frames=2), [1, 2, 3], "3 frames"),
        (Limits(max_frame_size=4), [1, 5, 1], "frame of 5 bytes"),
        (Limits(max_message_size=6), [3, 3, 1], "message of 7 bytes"),
    ],
)
def test_whole_many_frame_message_in_the_buffer_is_checked(
    limits: Limits, lengths: list[int], match: str
) -> None:
    """A many-frame message that arrives whole (the decoder's fast path) meets the
    same limits as one that arrives in pieces."""
    decoder = FrameDecoder(limits)
    decoder.feed(PREAMBLE)
    decoder.next_handshake()
    decoder.feed(encode([bytes(n) for n in lengths]))
    with pytest.raises(RemoteProtocolError, match=match):
        decoder.next_message()


@pytest.mark.parametrize("count", [2, 3, 32, 33, 100])
def test_whole_message_of_short_frames(count: int) -> None:
    """Up to 32 frames: a list, one buffer per frame. More, some shorter than 64
    bytes: a PackedFrames whose short frames share one buffer."""
    decoder = FrameDecoder()
    decoder.feed(PREAMBLE)
    decoder.next_handshake()
    frames = [bytes([i % 256]) * (i % 7) for i in range(count)]
    decoder.feed(encode(frames, [b"next"]))
    message = decoder.next_message()
    assert message is not None and [bytes(f) for f in message] == frames
    if count <= 32:
        assert type(message) is list
        assert len({id(f.obj) for f in message}) == count  # no shared buffers
    else:
        assert type(message) is PackedFrames
        assert len({id(f.obj) for f in message}) == 1
    assert all(not f.readonly for f in message)
    second = decoder.next_message()
    assert second is not None and [bytes(f) for f in second] == [b"next"]
    assert decoder.next_message() is None


# -- many frames: what a peer's bytes make the decoder hold ---------------------


def _held_while_received(decoder: FrameDecoder, data: bytes) -> int:
    """Feed ``data`` in read-sized pieces; return the most the decoder held
    (traced growth, the bytes passed in excluded) while no message was taken."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        view = memoryview(data)
        while view:
            decoder.feed(view[:4096])
            view = view[4096:]
            assert decoder.next_message() is None
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("count", [33, 1000, 16_384])
@pytest.mark.parametrize("size", [0, 1, 31, 63, 64, 200])
def test_a_message_being_received_holds_at_most_8x_its_bytes(count: int, size: int) -> None:
    """The default limits allow 16,384 frames: as frame objects (about 380 bytes
    each) a peer's empty frames would cost 48 times their 8 bytes of header. Until
    the message is complete, short frames wait back to back: whatever the frame
    sizes, the decoder holds at most 8 times what arrived, plus one read-ahead
    buffer's worth (a frame shorter than a quarter of it gets its buffer when it
    starts)."""
    decoder = FrameDecoder(read_buffer_size=4096)
    decoder.feed(PREAMBLE)
    decoder.next_handshake()
    # the last frame is declared and never sent: the message stays incomplete
    header = encode_header([size] * (count - 1) + [1000])
    data = header + bytes([7]) * (size * (count - 1))
    held = _held_while_received(decoder, data)
    assert held <= 8 * len(data) + 4096, (held, len(data))
    assert decoder.received_in_message == len(data)


@pytest.mark.parametrize("sizes", [(0,), (1,), (63,), (0, 200), (63, 64, 1000)])
def test_a_deferred_message_holds_at_most_8x_its_bytes_until_taken(
    sizes: tuple[int, ...],
) -> None:
    """In mode CALLBACK (the push engine's callback), a complete many-frame message is not
    made into frame objects until the consumer takes it."""
    count = 16_384
    decoder = FrameDecoder()
    decoder.feed(PREAMBLE)
    decoder.next_handshake()
    decoder.state.mode = ReceiveMode.CALLBACK
    frames = [bytes([i % 256]) * sizes[i % len(sizes)] for i in range(count)]
    data = encode(frames)
    held = 0
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        view = memoryview(data)
        while view:
            if decoder.state.status is ReceiveStatus.TASK_READS_MANY:
                decoder.state.mode = ReceiveMode.TASK
                assert decoder.next_message() is None  # the consumer reads on
                decoder.state.mode = ReceiveMode.CALLBACK
            decoder.feed(view[:65536])
            view = view[65536:]
            assert decoder.next_message() is None
        held = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert held <= 8 * len(data) + 65536, (held, len(data))
    assert decoder.state.status is ReceiveStatus.TASK_READS_MANY
    decoder.state.mode = ReceiveMode.TASK
    message = decoder.next_message()
    assert message is not None and [bytes(f) for f in message] == frames
    assert (
        decoder.state.status is not ReceiveStatus.TASK_READS_MANY and decoder.at_message_boundary
    )


def test_frames_of_64_bytes_and_more_are_not_deferred() -> None:
    """Such frames hold less than 8 times their bytes as frame objects: a message of
    none but them is decoded at once (the push engine's callback takes it whole)."""
    decoder = FrameDecoder()
    decoder.feed(PREAMBLE)
    decoder.next_handshake()
    decoder.state.mode = ReceiveMode.CALLBACK
    frames = [bytes([i]) * 64 for i in range(40)]
    decoder.feed(encode(frames))
    assert [bytes(f) for f in decoder.next_message() or []] == frames
    assert decoder.state.status is not ReceiveStatus.TASK_READS_MANY


def test_deferred_frames_are_not_read_until_asked_for() -> None:
    decoder = FrameDecoder()
    decoder.feed(PREAMBLE)
    decoder.next_handshake()
    decoder.state.mode = ReceiveMode.CALLBACK
    frames = [b"ab"] * 40
    decoder.feed(encode(frames, [b"after"]))
    assert decoder.next_message() is None and decoder.state.status is ReceiveStatus.TASK_READS_MANY
    assert decoder.next_message() is None  # still deferred
    decoder.state.mode = ReceiveMode.TASK
    assert [bytes(f) for f in decoder.next_message() or []] == frames
    decoder.state.mode = ReceiveMode.CALLBACK
    assert [bytes(f) for f in decoder.next_message() or []] == [b"after"]  # few frames


def test_end_of_stream_while_many_frames_are_deferred() -> None:
    decoder = FrameDecoder()
    decoder.feed(PREAMBLE)
    decoder.next_handshake()
    decoder.state.mode = ReceiveMode.CALLBACK
    decoder.feed(encode_header([1] * 40) + b"x" * 10)
    decoder.receive_eof()
    assert decoder.next_message() is None and decoder.state.status is ReceiveStatus.TASK_READS_MANY
    decoder.state.mode = ReceiveMode.TASK
    with pytest.raises(EndOfData) as info:
        decoder.next_message()
    assert info.value.truncated
    assert decoder.state.status is not ReceiveStatus.TASK_READS_MANY


# frames of every kind in one many-frame message: packed (< 64 bytes), copied
# whole, filled across reads, and read directly into their buffer (>= 1024 here)
MIXED = [bytes([i % 256]) * n for i, n in enumerate([0, 1, 63, 64, 65, 5000, 0, 700] * 6)]


@pytest.mark.parametrize("split", [1, 7, 64, 1000, 4096, 100_000])
def test_many_frame_message_in_pieces(split: int) -> None:
    c = Collector(read_buffer_size=4096)
    stream = PREAMBLE + encode(MIXED, [b"next"], MIXED)
    for i in range(0, len(stream), split):
        c.feed(stream[i : i + split])
    assert c.messages == [MIXED, [b"next"], MIXED]


def test_many_frame_message_long_frames_have_their_own_buffers() -> None:
    """In a many-frame message, frames of 64 bytes and more have a buffer of their
    own, from the allocator; the short ones share one bytearray, whatever the
    allocator."""
    sizes: list[int] = []

    def allocator(n: int) -> bytearray:
        sizes.append(n)
        return bytearray(n)

    for kwargs in ({}, {"allocator": allocator}):
        decoder = FrameDecoder(read_buffer_size=4096, **kwargs)  # type: ignore[arg-type]
        decoder.feed(PREAMBLE)
        decoder.next_handshake()
        stream = memoryview(encode(MIXED))
        message = None
        while message is None:
            buffer = decoder.get_buffer()
            n = min(len(buffer), len(stream))
            buffer[:n] = stream[:n]
            stream = stream[n:]
            decoder.buffer_updated(n)
            message = decoder.next_message()
        assert type(message) is PackedFrames
        assert [bytes(f) for f in message] == MIXED
        long = [f for f in message if len(f) >= PACK_BELOW]
        short = [f for f in message if len(f) < PACK_BELOW]
        assert len({id(f.obj) for f in long}) == len(long)
        assert all(len(f.obj) == len(f) for f in long)  # type: ignore[arg-type]
        assert len({id(f.obj) for f in short}) == 1
        assert type(short[0].obj) is bytearray
        assert len(short[0].obj) == sum(map(len, short))  # type: ignore[arg-type]
        assert all(not f.readonly for f in message)
    assert sorted(sizes) == sorted(len(f) for f in MIXED if len(f) >= PACK_BELOW)


@pytest.mark.parametrize("lengths", [[2000, 2000], [3000, 10, 3000], [1] * 40 + [2000] * 3])
@pytest.mark.parametrize("step", [1, 7, 500, 4096])
def test_received_in_message_counts_what_arrived(lengths: list[int], step: int) -> None:
    """The message deadline's allowance grows with this count: it is exactly the
    bytes of the message that arrived, whatever the frame being filled."""
    decoder = FrameDecoder(read_buffer_size=4096)
    decoder.feed(PREAMBLE)
    decoder.next_handshake()
    data = encode([bytes(n) for n in lengths])
    fed = 0
    while fed < len(data) - step:
        buffer = decoder.get_buffer()
        n = min(step, len(buffer), len(data) - fed - 1)
        buffer[:n] = data[fed : fed + n]
        decoder.buffer_updated(n)
        fed += n
        assert decoder.next_message() is None
        assert decoder.received_in_message == fed


@pytest.mark.parametrize(
    "lengths",
    [[13, 300_000], [37, 200_000, 200_000, 5, 100_001], [70_000] * 3, [1, 2, 3] * 12 + [90_000]],
)
def test_frames_read_directly_into_a_pool_start_at_their_offset_in_the_message(
    lengths: list[int],
) -> None:
    """A pooled frame's buffer lies at the phase (modulo ALIGNMENT) of its offset in
    its message, so that the kernel's copy from the sender's pages is in phase, and
    every byte still lands where it belongs (the last case: a many-frame message)."""
    pool = BufferPool()
    d = FrameDecoder(read_buffer_size=4096, allocator=pool)
    d.feed(PREAMBLE)
    assert d.next_handshake() is not None
    frames = [bytes([i % 251]) * length for i, length in enumerate(lengths)]
    header = encode_header(lengths)
    offsets = list(accumulate(lengths, initial=len(header)))
    for _ in range(2):  # the second time into reused slabs
        view = memoryview(header + b"".join(frames))
        received = None
        while received is None:
            buf = d.get_buffer()
            n = min(len(buf), len(view), 50_000)
            buf[:n] = view[:n]
            d.buffer_updated(n)
            view = view[n:]
            received = d.next_message()
        assert [bytes(f) for f in received] == frames
        pooled = [i for i, f in enumerate(received) if type(f.obj) is not bytearray]
        assert pooled == [i for i, length in enumerate(lengths) if length >= pool.min_size]
        for i in pooled:
            where = ctypes.addressof(ctypes.c_char.from_buffer(received[i]))
            assert where % ALIGNMENT == offsets[i] % ALIGNMENT
        del received
    assert pool.statistics().reused == len(pooled)


# -- the read-ahead buffer before the peer's preamble ---------------------------


def _traced(make: object) -> int:
    """Bytes traced as still allocated after ``make()`` (whose result is kept)."""
    import gc
    import tracemalloc

    assert callable(make)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = make()
        after = tracemalloc.get_traced_memory()[0]
        del kept
        return after - before
    finally:
        tracemalloc.stop()


def test_a_decoder_waiting_for_the_preamble_holds_no_read_buffer() -> None:
    """A peer that connects and sends nothing (or part of a preamble) costs the
    small preamble buffer, not read_buffer_size bytes."""
    assert PREAMBLE_BUFFER_SIZE == 12 + 1024  # the longest valid preamble
    assert _traced(FrameDecoder) < 4096
    assert _traced(lambda: FrameDecoder(read_buffer_size=1 << 20)) < 4096
    d = FrameDecoder()
    assert d.get_buffer().nbytes == PREAMBLE_BUFFER_SIZE
    d.feed(PREAMBLE[:10])
    assert d.next_handshake() is None
    assert d.get_buffer().nbytes == PREAMBLE_BUFFER_SIZE - 10


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\n", b"\x16\x03\x01\x02\x00", MAGIC + b"\x00\x01\xff\xff"],
)
def test_a_bad_preamble_never_grows_the_read_buffer(garbage: bytes) -> None:
    d = FrameDecoder()
    d.feed(garbage)
    with pytest.raises(RemoteProtocolError):
        d.next_handshake()
    assert d.get_buffer().nbytes == PREAMBLE_BUFFER_SIZE


@pytest.mark.parametrize("early", [False, True], ids=["next_handshake", "on_handshake"])
@pytest.mark.parametrize("read_buffer_size", [4096, 65536])
def test_the_read_buffer_grows_once_the_preamble_is_parsed(
    early: bool, read_buffer_size: int
) -> None:
    """A reader that fills whatever get_buffer hands out: the first read takes the
    small buffer whole (the preamble and early data after it), and the messages
    that began there are completed out of the full-size buffer. The view of the
    small buffer that the reader still holds stays valid (it is replaced, not
    resized)."""
    messages = [[b"m%d" % i * 40] for i in range(200)] + [[bytes(range(256)) * 9, b"end"]]
    body = encode(*messages)
    stream = memoryview(PREAMBLE + body)
    d = FrameDecoder(read_buffer_size=read_buffer_size)
    handshakes: list[Handshake] = []
    if early:
        d.on_handshake = handshakes.append
    received: list[list[bytes]] = []
    first = d.get_buffer()
    assert first.nbytes == PREAMBLE_BUFFER_SIZE
    sizes = []
    while stream:
        buf = d.get_buffer()
        sizes.append(buf.nbytes)
        n = min(buf.nbytes, stream.nbytes)
        buf[:n] = stream[:n]
        d.buffer_updated(n)
        stream = stream[n:]
        if not early and not handshakes:
            handshake = d.next_handshake()
            assert handshake is not None  # the small buffer holds it whole
            handshakes.append(handshake)
        while (frames := d.next_message()) is not None:
            received.append([bytes(f) for f in frames])
    assert received == messages
    assert handshakes == [Handshake(2, Limits())]
    assert sizes[0] == PREAMBLE_BUFFER_SIZE
    assert sizes[1] > PREAMBLE_BUFFER_SIZE  # (less what the small buffer left over)
    assert max(sizes) == read_buffer_size
    # the reader's view of the small buffer: still the bytes it wrote there
    assert bytes(first[: len(PREAMBLE)]) == PREAMBLE
    first[:1] = b"!"  # writable, and no longer the decoder's
    assert d.get_buffer().nbytes == read_buffer_size


def test_feeding_a_preamble_and_more_than_the_small_buffer_at_once() -> None:
    """feed() (Connection.receive_data) takes a preamble and any early data after
    it in one call, as it did with a full-size buffer from the start."""
    d = FrameDecoder(read_buffer_size=4096)
    messages = [[b"x" * 500] for _ in range(6)]
    d.feed(PREAMBLE + encode(*messages))
    assert d.next_handshake() is not None
    assert [[bytes(f) for f in d.next_message() or []] for _ in messages] == messages
    assert d.next_message() is None
    assert d.get_buffer().nbytes == 4096
