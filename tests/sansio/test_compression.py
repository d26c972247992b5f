"""Compressed frames (wire format section 6.1) without an event loop: what the sender
compresses, how the receiver checks and decompresses them, in any chunking."""

from __future__ import annotations

import os
import random
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anyio_comm import Limits, RemoteProtocolError
from anyio_comm._sansio.compression import (
    LENGTH_MASK,
    MIN_COMPRESSED_SIZE,
    Compressor,
    check_codecs,
)
from anyio_comm._sansio.connection import Connection, ReceiveMode, ReceiveStatus
from anyio_comm._sansio.decoder import FrameDecoder
from anyio_comm._sansio.pool import BufferPool
from anyio_comm._sansio.wire import Capability, encode_header, encode_preamble

cramjam = pytest.importorskip("cramjam")

WORDS = [bytes.fromhex(f"{i:04x}") * 3 for i in range(300)]


def text(size: int, seed: int = 1) -> bytes:
    """Compressible bytes: words from a small vocabulary."""
    rng = random.Random(seed)
    return b" ".join(rng.choice(WORDS) for _ in range(size // 6 + 1))[:size]


def connected(sender_codecs: tuple[str, ...], receiver_codecs: tuple[str, ...], **receiver):
    """A sender and a receiver Connection that read each other's preambles."""
    sender = Connection(compression=sender_codecs)
    receiver_conn = Connection(compression=receiver_codecs, **receiver)
    sender.receive_data(receiver_conn.preamble())
    receiver_conn.receive_data(sender.preamble())
    assert sender.next_handshake() is not None
    assert receiver_conn.next_handshake() is not None
    return sender, receiver_conn


def wire(buffers: list) -> bytes:
    return b"".join(bytes(buffer) for buffer in buffers)


def receive(conn: Connection, data: bytes, chunks: list[int]) -> list[list[bytes]]:
    """Feed ``data`` to ``conn`` in pieces of the ``chunks`` sizes (cycled), through
    get_buffer/buffer_updated as a socket reader would; return the messages."""
    messages = []
    view = memoryview(data)
    i = 0
    while True:
        while (frames := conn.next_message()) is not None or (
            conn.receiving.status is ReceiveStatus.DECOMPRESS
        ):
            if frames is None:  # (as the I/O layer does, in a worker thread say)
                conn.prepare_decompression()
                conn.decompress()
            else:
                messages.append([bytes(frame) for frame in frames])
        if not view:
            return messages
        buffer = conn.get_buffer()
        n = min(buffer.nbytes, view.nbytes, chunks[i % len(chunks)])
        i += 1
        buffer[:n] = view[:n]
        conn.buffer_updated(n)
        view = view[n:]


def test_codec_names_are_checked() -> None:
    assert check_codecs(("zstd", "lz4")) == ("zstd", "lz4")
    with pytest.raises(ValueError, match="unknown compression codec 'gzip'"):
        check_codecs(("gzip",))
    with pytest.raises(ValueError, match="twice"):
        check_codecs(("lz4", "lz4"))


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_what_the_sender_compresses(codec: str) -> None:
    compressor = Compressor(codec)
    assert compressor.compress(memoryview(text(MIN_COMPRESSED_SIZE - 1))) is None  # small
    assert compressor.compress(memoryview(os.urandom(1_000_000))) is None  # incompressible
    # a compressible sample but an incompressible whole: sent as it is
    mixed = bytearray(os.urandom(1_000_000))
    step = (len(mixed) - 2048) // 4
    for i in range(5):
        mixed[i * step : i * step + 2048] = bytes(2048)
    assert compressor.compress(memoryview(mixed)) is None
    data = text(1_000_000)
    wire_frame = compressor.compress(memoryview(data))
    assert wire_frame is not None
    (compressed,) = struct.unpack_from("!Q", wire_frame)
    assert compressed == wire_frame.nbytes - 8 < 0.9 * len(data)


@pytest.mark.parametrize("codecs", [("lz4",), ("zstd",), ("zstd", "lz4")])
def test_the_sender_uses_the_first_of_its_codecs_the_receiver_accepts(codecs) -> None:
    sender, receiver = connected(codecs, ("lz4", "zstd"))
    data = text(300_000)
    buffers = sender.send_message([memoryview(data)])
    (entry,) = struct.unpack_from("!Q", bytes(buffers[0]), 4)
    assert entry >> 56 == {"lz4": 1, "zstd": 2}[codecs[0]]
    assert entry & (2**56 - 1) == len(data)
    assert len(wire(buffers)) < 0.9 * len(data)
    assert receive(receiver, wire(buffers), [65536]) == [[data]]


@pytest.mark.parametrize(
    ("sender_codecs", "receiver_codecs"), [(("lz4",), ()), ((), ("lz4",)), (("lz4",), ("zstd",))]
)
def test_no_compression_unless_both_sides_agree(sender_codecs, receiver_codecs) -> None:
    sender, receiver = connected(sender_codecs, receiver_codecs)
    data = text(300_000)
    buffers = sender.send_message([memoryview(data)])
    assert wire(buffers) == encode_header([len(data)]) + data
    assert receive(receiver, wire(buffers), [65536]) == [[data]]


def test_no_compression_on_a_version_1_connection() -> None:
    sender = Connection(compression=("lz4",))
    old = Connection(version=1)
    sender.receive_data(old.preamble())
    assert sender.next_handshake() is not None
    assert sender.peer.compression == ()  # type: ignore[union-attr]
    data = text(300_000)
    assert wire(sender.send_message([memoryview(data)])) == encode_header([len(data)]) + data
    # and a side that accepts compression reads a version-1 peer's lengths as lengths
    receiver = FrameDecoder(
        Limits(max_frame_size=2**62, max_message_size=2**62), compression=("lz4",)
    )
    receiver.feed(old.preamble() + encode_header([2**56 + 64]))
    assert receiver.next_handshake() is not None
    assert receiver.next_message() is None  # a (very long) stored frame, not a codec


@settings(max_examples=60, deadline=None, database=None)
@given(
    shapes=st.lists(
        st.lists(
            st.sampled_from(["text", "random", "small", "empty", "zeros", "short-zeros"]),
            max_size=40,
        ),
        min_size=1,
        max_size=4,
    ),
    chunks=st.lists(st.integers(1, 200_000), min_size=1, max_size=5),
    read_buffer_size=st.sampled_from([4096, 65536]),
    codec=st.sampled_from(["lz4", "zstd"]),
    pooled=st.booleans(),
    seed=st.integers(0, 2**32),
    offload_min=st.sampled_from([None, 1, 100_000]),
    check_every=st.sampled_from([None, 0, 300_000]),
)
def test_round_trip_in_any_chunking(
    shapes, chunks, read_buffer_size, codec, pooled, seed, offload_min, check_every
) -> None:
    """Messages of compressed and stored frames (and many-frame messages, whose short
    frames the receiver packs, beside short compressed frames, which it does not)
    arrive intact whatever the reads' sizes, and whichever decompressions are left
    to the I/O layer."""
    allocator = BufferPool() if pooled else None
    sender, receiver = connected(
        (codec,), ("lz4", "zstd"), read_buffer_size=read_buffer_size, allocator=allocator
    )
    if offload_min is not None or check_every is not None:
        receiver.start_receiving(
            ReceiveMode.PULL,
            offload_min=LENGTH_MASK + 1 if offload_min is None else offload_min,
            check_every=LENGTH_MASK + 1 if check_every is None else check_every,
        )
    # The reference sender compresses nothing under 64 KiB; the protocol allows any
    # frame of 2 bytes or more, which the receiver must read in any message.
    sender._compressor = Compressor(codec, min_size=2)
    rng = random.Random(seed)
    make = {
        "text": lambda: text(rng.randrange(MIN_COMPRESSED_SIZE, 300_000), rng.random()),
        "random": lambda: rng.randbytes(rng.randrange(MIN_COMPRESSED_SIZE, 200_000)),
        "small": lambda: rng.randbytes(rng.randrange(1, 64)),
        "empty": lambda: b"",
        "zeros": lambda: bytes(rng.randrange(MIN_COMPRESSED_SIZE, 500_000)),
        "short-zeros": lambda: bytes(rng.randrange(30, 64)),
    }
    messages = [[make[kind]() for kind in shape] for shape in shapes]
    data = b"".join(wire(sender.send_message([memoryview(f) for f in m])) for m in messages)
    assert receive(receiver, data, chunks) == messages


def decoder_after_preamble(limits: Limits | None = None) -> FrameDecoder:
    decoder = FrameDecoder(limits, compression=("lz4",))
    decoder.feed(encode_preamble(Limits()))
    assert decoder.next_handshake() is not None
    return decoder


def compressed_message(length: int, data: bytes, codec: int = 1) -> bytes:
    entry = (codec << 56) | length
    return struct.pack("!IQQ", 1, entry, len(data)) + data


def lz4(data: bytes) -> bytes:
    out = bytearray(len(data) + 1024)
    n = cramjam.lz4.compress_block_into(data, out, store_size=False)
    return bytes(out[:n])


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (struct.pack("!IQ", 1, 1 << 56), "compressed frame 0 of length 0"),
        (compressed_message(64, b""), "announces 0 compressed bytes"),
        (compressed_message(64, bytes(64)), "announces 64 compressed bytes"),
        (compressed_message(65, lz4(b"a" * 64)), "decompressed to 64 bytes, not its 65"),
        (compressed_message(63, lz4(b"a" * 64)), "does not decompress to its 63 bytes"),
        (compressed_message(64, lz4(b"a" * 64), codec=7), "codec 7, which we did not announce"),
    ],
    ids=["length-0", "compressed-0", "not-smaller", "short-output", "long-output", "codec"],
)
def test_malformed_compressed_frames(message: bytes, error: str) -> None:
    decoder = decoder_after_preamble()
    decoder.feed(message)
    with pytest.raises(RemoteProtocolError, match=error) as info:
        decoder.next_message()
    assert info.value.rule == "wire-format"


def test_limits_apply_to_the_uncompressed_size() -> None:
    decoder = decoder_after_preamble(Limits(max_frame_size=1000))
    decoder.feed(compressed_message(1001, lz4(b"a" * 1001))[:12])  # the header alone
    with pytest.raises(RemoteProtocolError, match="frame of 1001 bytes") as info:
        decoder.next_message()
    assert info.value.rule == "max_frame_size"
    decoder = decoder_after_preamble(Limits(max_frame_size=1000))
    decoder.feed(compressed_message(1000, lz4(b"a" * 1000)))
    assert decoder.next_message() == [b"a" * 1000]


def test_a_peer_announcing_compression_is_seen() -> None:
    conn = Connection(compression=("zstd",))
    conn.receive_data(encode_preamble(Limits(), compression=("lz4", "zstd")))
    handshake = conn.next_handshake()
    assert handshake is not None and handshake.compression == ("lz4", "zstd")
    assert Capability.COMPRESSION in handshake.capabilities
    # a value of codecs none of which is known announces nothing
    conn = Connection()
    body = encode_preamble(Limits())[12:] + bytes.fromhex("0003 0002 0909")
    conn.receive_data(b"\x89ACOMM\r\n" + struct.pack("!HH", 2, len(body)) + body)
    handshake = conn.next_handshake()
    assert handshake is not None and handshake.compression == ()
    assert Capability.COMPRESSION not in handshake.capabilities


def test_received_in_message_counts_the_compressed_bytes() -> None:
    """A message of compressed frames counts what arrived, not what it decompresses to
    (the message timeout's allowance grows with it)."""
    data = bytes(1_000_000)
    compressed = lz4(data)
    message = struct.pack("!IQQQ", 2, (1 << 56) | len(data), 10, len(compressed))
    message += compressed + b"x" * 10
    decoder = decoder_after_preamble()
    seen = []
    for i in range(len(message) - 1):
        decoder.feed(message[i : i + 1])
        assert decoder.next_message() is None
        seen.append(decoder.received_in_message)
    assert seen == list(range(1, len(message)))
    decoder.feed(message[-1:])
    assert decoder.next_message() == [data, b"x" * 10]
    assert decoder.received_in_message == 0


def test_received_in_message_starts_afresh_after_a_compressed_message() -> None:
    """The next message counts its own bytes from its first one, its length table
    included (a count left over from a compressed message made it negative, and a
    message that had begun timed out at once)."""
    data = bytes(1_000_000)
    decoder = decoder_after_preamble()
    decoder.feed(compressed_message(len(data), lz4(data)))
    assert decoder.next_message() == [data]
    header = struct.pack("!IQQ", 2, 5, 6)
    for i in range(1, len(header)):
        decoder.feed(header[i - 1 : i])
        assert decoder.next_message() is None
        assert decoder.received_in_message == i


@pytest.mark.parametrize(
    "entries",
    [
        [2000, (7 << 56) | 64],  # over max_frame_size, then a codec not listed
        [(7 << 56) | 64, 2000],
        [2000, 1 << 56],  # over max_frame_size, then a compressed frame of length 0
        [(1 << 56) | 600, 600, (1 << 56) | 0],  # over max_message_size, then length 0
    ],
    ids=["limit-then-codec", "codec-then-limit", "limit-then-zero", "sum-then-zero"],
)
def test_codec_checks_come_before_the_limits(entries: list[int]) -> None:
    """Spec 6.1: a receiver that announced compression checks every entry's codec and
    compressed length 0 before the limits of section 5: PROTOCOL_ERROR, not a limit."""
    decoder = decoder_after_preamble(Limits(max_frame_size=1000, max_message_size=1000))
    decoder.feed(encode_header(entries))
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_message()
    assert info.value.rule == "wire-format"


def test_each_frame_is_checked_before_the_sum() -> None:
    """Spec 5: a table over max_message_size early and over max_frame_size late is
    refused as over max_frame_size, the name its LIMIT_EXCEEDED record carries."""
    decoder = decoder_after_preamble(Limits(max_frame_size=1000, max_message_size=1500))
    decoder.feed(encode_header([900, 900, 1001]))
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_message()
    assert info.value.rule == "max_frame_size"


@pytest.mark.parametrize(
    ("value", "codecs"),
    [("010201", ("lz4", "zstd")), ("020102", ("zstd", "lz4")), ("0101", ("lz4",))],
)
def test_a_codec_listed_twice_counts_at_its_first_position(
    value: str, codecs: tuple[str, ...]
) -> None:
    """Spec 4.10: a receiver accepts a CAP_COMPRESSION value that lists a codec twice."""
    conn = Connection(compression=("lz4", "zstd"))
    entry = struct.pack("!HH", 3, len(value) // 2) + bytes.fromhex(value)
    body = encode_preamble(Limits())[12:] + entry
    conn.receive_data(b"\x89ACOMM\r\n" + struct.pack("!HH", 2, len(body)) + body)
    handshake = conn.next_handshake()
    assert handshake is not None and handshake.compression == codecs


def test_a_large_frame_is_decompressed_when_the_io_layer_says() -> None:
    """With ``offload_min``, next_message() stops at a compressed frame that long
    (nothing consumed, however often asked) until decompress() ran, which may
    run in another thread and raises nothing."""
    data = bytes(150_000) + text(20_000)  # (compressed, less than the read-ahead buffer)
    decoder = decoder_after_preamble()
    decoder.inflater.offload_min = 100_000
    assert decoder.state.status is not ReceiveStatus.DECOMPRESS and decoder.inflater.job is None
    with pytest.raises(RuntimeError, match="no decompression is due"):
        decoder.decompress()
    decoder.feed(
        compressed_message(len(data), lz4(data)) + compressed_message(1000, lz4(bytes(1000)))
    )
    for _ in range(3):
        assert decoder.next_message() is None
        assert (
            decoder.state.status is ReceiveStatus.DECOMPRESS
            and decoder.inflater.job_size == len(data)
        )
    decoder.inflater.prepare()
    worker = threading.Thread(target=decoder.decompress)
    worker.start()
    worker.join()
    assert decoder.state.status is not ReceiveStatus.DECOMPRESS
    assert decoder.next_message() == [data]
    assert decoder.next_message() == [bytes(1000)]  # short: decompressed in next_message()
    assert decoder.at_message_boundary


def test_a_bad_frame_left_to_the_io_layer_fails_the_next_call() -> None:
    decoder = decoder_after_preamble()
    decoder.inflater.offload_min = 64
    decoder.feed(compressed_message(65, lz4(b"a" * 64)))
    assert decoder.next_message() is None and decoder.state.status is ReceiveStatus.DECOMPRESS
    decoder.inflater.prepare()
    decoder.decompress()  # raises nothing
    for _ in range(2):  # sticky, as any protocol error
        with pytest.raises(RemoteProtocolError, match="decompressed to 64 bytes, not its 65"):
            decoder.next_message()
    error = decoder.end_error
    assert error is not None and error.__traceback__ is None and error.__context__ is None


def test_check_every_leaves_a_small_frame_to_the_io_layer_now_and_then() -> None:
    """After ``check_every`` bytes decompressed in next_message(), the next
    compressed frame, however short, waits for the I/O layer (which checks that
    the peer is still there before it runs it)."""
    decoder = decoder_after_preamble()
    decoder.inflater.check_every = 2500
    decoder.feed(compressed_message(1000, lz4(bytes(1000))) * 6)
    due = []
    for _ in range(6):
        frames = decoder.next_message()
        if frames is None:
            assert decoder.inflater.job_size
            due.append(decoder.inflater.job_size)
            decoder.inflater.prepare()
            decoder.decompress()
            frames = decoder.next_message()
        assert frames == [bytes(1000)]
    assert due == [1000, 1000]  # the 3rd and the 6th (the count restarts when one ran)


def test_a_pool_buffer_is_taken_when_the_io_layer_prepares_it() -> None:
    """With an allocator other than the default one, the frame's buffer comes from
    it in the inflater's prepare() (the event loop's thread), not before."""
    taken = []

    def allocator(n: int) -> bytearray:
        taken.append(n)
        return bytearray(n)

    decoder = FrameDecoder(compression=("lz4",), allocator=allocator)
    decoder.feed(encode_preamble(Limits()))
    assert decoder.next_handshake() is not None
    decoder.inflater.offload_min = 1000
    data = text(5000)
    decoder.feed(compressed_message(len(data), lz4(data)))
    assert decoder.next_message() is None
    assert len(data) not in taken
    decoder.inflater.prepare()
    assert taken.count(len(data)) == 1
    decoder.inflater.prepare()  # (once)
    assert taken.count(len(data)) == 1
    decoder.decompress()
    assert decoder.next_message() == [data]
