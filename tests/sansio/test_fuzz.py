"""Hostile input for the sans-IO core: the frame decoder and the message deserializer.

Whatever bytes a peer sends, however they are split into reads:

* the decoder yields exactly the messages that were encoded, or raises
  ``RemoteProtocolError`` (``EndOfData`` after ``receive_eof()`` is the end of
  the stream), never any other exception, and its outcome does not depend on
  how the bytes were split;
* it never asks its allocator for more than ``max_frame_size`` per frame or
  ``max_message_size`` per message, allocates nothing for a header that breaks
  the limits, and keeps its total memory (tracemalloc, so allocations that do
  not go through the allocator count too) within one read-ahead buffer plus
  one message;
* a call that returns ``None`` always leaves room for more input, so a reader
  loop cannot spin: every decode below runs under a step budget derived from
  the input length;
* ``Serializer.loads`` turns every malformed body (bad msgpack, unknown
  extension types, out-of-band references out of range, depth bombs, huge
  declared lengths) into ``RemoteProtocolError``, and without
  ``allow_pickle`` never unpickles anything.
"""

from __future__ import annotations

import pickle
import random
import struct
import tracemalloc
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from anyio_comm import Limits, RemoteProtocolError
from anyio_comm._sansio.decoder import EndOfData, FrameDecoder
from anyio_comm._sansio.serialization import EXT_OOB, EXT_PICKLE, Serializer
from anyio_comm._sansio.wire import (
    MAGIC,
    Capability,
    Handshake,
    encode_header,
    encode_preamble,
)

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from anyio_comm._sansio.buffers import Allocator

#: our receive limits in most tests: small enough that every limit is reachable
LIMITS = Limits(max_frames=8, max_frame_size=4096, max_message_size=16384)
#: more limit shapes: all zero, a message limit that is not a multiple of the
#: frame limit, and a length table (8 * 600 bytes) larger than the read buffer
OTHER_LIMITS = [
    Limits(max_frames=0, max_frame_size=0, max_message_size=0),
    Limits(max_frames=3, max_frame_size=10, max_message_size=25),
    Limits(max_frames=600, max_frame_size=64, max_message_size=1000),
]
#: 4096 is the smallest allowed; reads go straight into a frame's buffer when
#: a quarter of the read buffer or more of it is missing
READ_BUFFER_SIZES = [4096, 8192]
#: Python objects the decoder keeps per frame of a message: a length in the
#: table and as an int, a buffer object and a memoryview (about 400 bytes)
FRAME_OVERHEAD = 512
PREAMBLE = encode_preamble(Limits())
U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1


def _capability_entries(entries: bytes) -> frozenset[Capability] | None:
    """The known capabilities of a list of version-2 capability entries, ``None``
    if it is malformed (a model of wire-format section 4.6, written apart from the
    package's parser)."""
    seen = set()
    while entries:
        if len(entries) < 4:
            return None
        ident, size = struct.unpack_from("!HH", entries)
        if ident in seen or len(entries) < 4 + size:
            return None
        seen.add(ident)
        entries = entries[4 + size :]
    return frozenset(Capability(i) for i in seen if i in {1, 2})


def fuzz(max_examples: int) -> settings:
    """Hypothesis settings: no example database, no deadline (the machine is shared)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- decoding harness ---------------------------------------------------------


class CountingAllocator:
    """Records every frame allocation and checks it against the decoder's limits."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.sizes: list[int] = []
        self.outstanding = 0  # bytes allocated for the message being received

    def __call__(self, nbytes: int) -> bytearray:
        assert 0 <= nbytes <= self.limits.max_frame_size, f"allocation of {nbytes} bytes"
        self.outstanding += nbytes
        assert self.outstanding <= self.limits.max_message_size, (
            f"{self.outstanding} bytes allocated for one message"
        )
        self.sizes.append(nbytes)
        return bytearray(nbytes)

    def message_done(self) -> None:
        self.outstanding = 0


@dataclass
class Outcome:
    """What a decoder made of a byte stream."""

    handshake: Handshake | None = None
    messages: list[list[bytes]] = field(default_factory=list)
    #: "eof" (clean end), "truncated" (EOF inside a preamble or message),
    #: "protocol" (RemoteProtocolError)
    end: str = ""
    error: Exception | None = None

    def summary(self) -> tuple[object, ...]:
        return (self.handshake, self.messages, self.end)


def decode(
    data: bytes,
    chunks: Sequence[int] = (),
    *,
    limits: Limits = LIMITS,
    read_buffer_size: int = 4096,
    allocator: Allocator | None = None,
    keep: bool = True,
    eof: bool = True,
) -> Outcome:
    """Feed ``data`` through get_buffer()/buffer_updated() and drain it as a comm does.

    ``chunks`` are the sizes of successive reads, cycled (a read also stops at
    the end of the buffer the decoder offers). A size of 0 is a read that was
    abandoned (a cancelled ``recv_into``): junk is written into the buffer and
    never reported, then one byte is read. With ``eof`` the stream ends after
    ``data``; without it, decoding stops when the decoder needs more input
    (``end`` stays empty).

    Every step either consumes input, delivers the EOF, or completes a
    handshake or message (each at least 4 bytes of input), so a decoder that
    needs more steps than that is looping without progress.
    """
    decoder = FrameDecoder(limits, read_buffer_size=read_buffer_size, allocator=allocator)
    out = Outcome()
    sizes = list(chunks) or [max(len(data), 1)]
    view = memoryview(data)
    pos = turn = 0
    eof_sent = False
    budget = len(data) + len(data) // 4 + 4
    for _ in range(budget):
        try:
            if out.handshake is None:
                out.handshake = decoder.next_handshake()
                result: object = out.handshake
            else:
                frames = decoder.next_message()
                result = frames is not None or None
                if frames is not None:
                    out.messages.append([bytes(f) for f in frames] if keep else [])
                    if isinstance(allocator, CountingAllocator):
                        allocator.message_done()
                del frames  # hold no message while the next one is decoded
        except RemoteProtocolError as exc:
            out.end, out.error = "protocol", exc
            return out
        except EndOfData as exc:
            assert eof_sent, "EndOfData before receive_eof()"
            out.end, out.error = ("truncated" if exc.truncated else "eof"), exc
            return out
        if result is not None:
            continue
        assert not eof_sent, "returned None after receive_eof(): it must finish or raise"
        if pos == len(data):
            if not eof:
                return out
            decoder.receive_eof()
            eof_sent = True
            continue
        size = sizes[turn % len(sizes)]
        turn += 1
        buffer = decoder.get_buffer()
        assert buffer.nbytes > 0, "the decoder needs input but offers no room for it"
        if size == 0:
            buffer[: min(buffer.nbytes, 7)] = b"\xee" * min(buffer.nbytes, 7)
            buffer = decoder.get_buffer()
            assert buffer.nbytes > 0
            size = 1
        n = min(buffer.nbytes, size, len(data) - pos)
        buffer[:n] = view[pos : pos + n]
        decoder.buffer_updated(n)
        pos += n
    pytest.fail(f"no outcome after {budget} steps for {len(data)} bytes of input")


def encode_stream(messages: Sequence[Sequence[bytes]]) -> bytes:
    return b"".join(encode_header([len(f) for f in m]) + b"".join(m) for m in messages)


def boundaries(messages: Sequence[Sequence[bytes]], start: int) -> list[int]:
    """Offsets in the stream at which each message ends."""
    ends = []
    for m in messages:
        start += 4 + 8 * len(m) + sum(len(f) for f in m)
        ends.append(start)
    return ends


# -- strategies ----------------------------------------------------------------

#: read sizes, cycled; each cycle ends with a large read so long streams stay quick
#: (byte-at-a-time feeding has its own test)
chunk_lists = st.lists(
    st.integers(0, 3) | st.integers(1, 5000) | st.sampled_from([4, 11, 12, 1023, 1024, 4096]),
    max_size=20,
).map(lambda sizes: [*sizes, 8192])


@st.composite
def frame_lists(
    draw: st.DrawFn, limits: Limits = LIMITS, max_total: int | None = None
) -> list[bytes]:
    """One message within ``limits``: frame sizes at, around and below each limit."""
    budget = limits.max_message_size if max_total is None else max_total
    rng = random.Random(draw(st.integers(0, U32_MAX)))
    frames = []
    mf = limits.max_frames
    count = draw(
        st.sampled_from([0, min(1, mf), max(mf - 1, 0), mf]) | st.integers(0, min(mf, 10))
    )
    for i in range(count):
        top = min(limits.max_frame_size, budget)
        if i < 10:
            size = draw(
                st.sampled_from([0, min(1, top), max(top - 1, 0), top]) | st.integers(0, top)
            )
        else:  # long frame lists: sizes from the seeded generator, to keep drawing cheap
            size = rng.choice([0, min(1, top), top, rng.randint(0, top)])
        budget -= size
        frames.append(rng.randbytes(size))
    return frames


def message_streams(limits: Limits = LIMITS, max_total: int | None = None) -> Any:
    return st.lists(frame_lists(limits, max_total), max_size=4)


interesting_lengths = st.sampled_from(
    [
        *(0, 1, 2, 7, 8, 1023, 1024, 4095, 4096, 4097, 16383, 16384, 16385),
        *(2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, U64_MAX - 1, U64_MAX),
    ]
) | st.integers(0, U64_MAX)


# -- valid streams -------------------------------------------------------------


@fuzz(100)
@given(
    messages=message_streams(),
    chunks=chunk_lists,
    read_buffer_size=st.sampled_from(READ_BUFFER_SIZES),
)
def test_valid_stream_any_chunking(
    messages: list[list[bytes]], chunks: list[int], read_buffer_size: int
) -> None:
    allocator = CountingAllocator(LIMITS)
    out = decode(
        PREAMBLE + encode_stream(messages),
        chunks,
        read_buffer_size=read_buffer_size,
        allocator=allocator,
    )
    assert out.end == "eof", out.error
    assert out.handshake == Handshake(version=2, limits=Limits())
    assert out.messages == messages
    assert allocator.sizes == [len(f) for m in messages for f in m]


@fuzz(40)
@given(messages=message_streams(max_total=300))
def test_valid_stream_one_byte_at_a_time(messages: list[list[bytes]]) -> None:
    out = decode(PREAMBLE + encode_stream(messages), [1], allocator=CountingAllocator(LIMITS))
    assert out.end == "eof", out.error
    assert out.messages == messages


@fuzz(60)
@given(
    limits=st.sampled_from(OTHER_LIMITS),
    data=st.data(),
    chunks=chunk_lists,
)
def test_valid_stream_other_limits(limits: Limits, data: st.DataObject, chunks: list[int]) -> None:
    messages = data.draw(message_streams(limits))
    out = decode(
        PREAMBLE + encode_stream(messages),
        chunks,
        limits=limits,
        allocator=CountingAllocator(limits),
    )
    assert out.end == "eof", out.error
    assert out.messages == messages


# -- truncation ----------------------------------------------------------------


@fuzz(120)
@given(messages=message_streams(max_total=2000), data=st.data(), chunks=chunk_lists)
def test_truncated_stream(
    messages: list[list[bytes]], data: st.DataObject, chunks: list[int]
) -> None:
    stream = PREAMBLE + encode_stream(messages)
    ends = boundaries(messages, len(PREAMBLE))
    # header fields are where truncation is most interesting: cut inside them often
    header_cuts = [
        start + k for start in [len(PREAMBLE), *ends[:-1]] for k in (1, 2, 3, 4, 5, 11, 12)
    ]
    cut = data.draw(
        st.integers(0, len(stream)) | st.sampled_from([*header_cuts, *ends, 5, 11, 12, 31])
    )
    cut = min(cut, len(stream))
    out = decode(stream[:cut], chunks, allocator=CountingAllocator(LIMITS))
    complete = [m for m, end in zip(messages, ends, strict=True) if end <= cut]
    assert out.messages == complete
    clean = cut == len(PREAMBLE) or cut in ends
    assert out.end == ("eof" if clean else "truncated"), (cut, out.error)
    if cut < len(PREAMBLE):
        assert out.handshake is None


# -- arbitrary and mutated bytes -----------------------------------------------


@fuzz(300)
@given(
    prefix=st.sampled_from([b"", PREAMBLE, MAGIC]),
    payload=st.binary(max_size=3000),
    chunks=chunk_lists,
    read_buffer_size=st.sampled_from(READ_BUFFER_SIZES),
    limits=st.sampled_from([LIMITS, *OTHER_LIMITS]),
)
def test_arbitrary_bytes(
    prefix: bytes, payload: bytes, chunks: list[int], read_buffer_size: int, limits: Limits
) -> None:
    data = prefix + payload
    allocator = CountingAllocator(limits)
    out = decode(
        data, chunks, limits=limits, read_buffer_size=read_buffer_size, allocator=allocator
    )
    assert out.end in ("eof", "truncated", "protocol")
    # the outcome is a function of the bytes, not of how they were split
    assert out.summary() == decode(data, limits=limits).summary()


@fuzz(150)
@given(
    version=st.sampled_from([0, 1, 2, 0xFFFF]) | st.integers(0, 0xFFFF),
    body_length=st.sampled_from([0, 1, 19, 20, 21, 28, 1023, 1024, 1025, 0xFFFF])
    | st.integers(0, 0xFFFF),
    body_seed=st.integers(0, U32_MAX),
    short_by=st.sampled_from([0, 0, 0, 1, 5]),
    messages=message_streams(max_total=500),
    chunks=chunk_lists,
)
# the edges of the accepted body lengths, and version 0, are always tried
@example(1, 19, 0, 0, [], [8192])
@example(1, 20, 0, 0, [[b"x"]], [8192])
@example(2, 1024, 0, 0, [[b"x"]], [8192])
@example(1, 1025, 0, 0, [], [8192])
@example(0, 20, 0, 0, [], [8192])
def test_arbitrary_preamble_fields(
    version: int,
    body_length: int,
    body_seed: int,
    short_by: int,
    messages: list[list[bytes]],
    chunks: list[int],
) -> None:
    rng = random.Random(body_seed)
    body = rng.randbytes(min(body_length, 1100))
    if body_seed % 2 and 20 <= body_length <= 1024:
        # capability entries that fill the body exactly, unknown ids among them
        # (random bytes rarely form valid ones)
        entries = bytearray()
        while body_length - 20 - len(entries) >= 4:
            size = rng.randrange(0, min(8, body_length - 24 - len(entries)) + 1)
            entries += struct.pack("!HH", len(entries) + 0x100, size) + rng.randbytes(size)
        body = body[:20] + entries + bytes(body_length - 20 - len(entries))
    body = body[: max(len(body) - short_by, 0)]
    head = MAGIC + struct.pack("!HH", version, body_length)
    after = encode_stream(messages) if len(body) == body_length else b""
    out = decode(head + body + after, chunks)
    if version == 0 or not 20 <= body_length <= 1024:
        # rejected on the 12 fixed bytes alone, without waiting for the body
        assert out.end == "protocol"
        assert decode(head, eof=False).end == "protocol"
    elif len(body) < body_length:
        assert out.end == "truncated"
        assert out.handshake is None
    else:
        max_frames, max_frame_size, max_message_size = struct.unpack_from("!IQQ", body)
        capabilities = frozenset() if version == 1 else _capability_entries(body[20:])
        if capabilities is None:
            assert out.end == "protocol"
            assert out.handshake is None
            return
        assert out.handshake == Handshake(
            min(version, 2), Limits(max_frames, max_frame_size, max_message_size), capabilities
        )
        assert out.end == "eof", out.error
        assert out.messages == messages


@fuzz(60)
@given(
    position=st.integers(0, len(MAGIC) - 1),
    flip=st.integers(1, 255),
    rest=st.binary(max_size=40),
)
def test_bad_magic_is_rejected_at_the_first_wrong_byte(
    position: int, flip: int, rest: bytes
) -> None:
    bad = bytearray(MAGIC)
    bad[position] ^= flip
    prefix = bytes(bad[: position + 1])
    # no EOF and nothing after the wrong byte: the decoder must not wait for more
    assert decode(prefix, [1], eof=False).end == "protocol"
    assert decode(prefix + rest, eof=True).end == "protocol"


# -- header limits -------------------------------------------------------------


@st.composite
def headers(draw: st.DrawFn) -> tuple[Limits, int, list[int] | None]:
    """(limits, frame count, frame lengths or None when only the count is sent)."""
    limits = draw(st.sampled_from([LIMITS, *OTHER_LIMITS]))
    mf, mfs, mms = limits.max_frames, limits.max_frame_size, limits.max_message_size
    count = draw(
        st.sampled_from([0, 1, max(mf - 1, 0), mf, mf + 1, mf + 2, 2**31, U32_MAX])
        | st.integers(0, mf + 3)
    )
    if count > mf + 2:
        return limits, count, None
    near = [0, 1, max(mfs - 1, 0), mfs, mfs + 1, max(mms - 1, 0), mms, mms + 1]
    length_values = st.sampled_from(near) | interesting_lengths
    if draw(st.booleans()) and count:
        # lengths summing to just below, at or just past max_message_size
        target = draw(st.sampled_from([max(mms - 1, 0), mms, mms + 1]))
        lengths = []
        for _ in range(count):
            lengths.append(min(mfs, target))
            target -= lengths[-1]
        assume(target == 0)
    else:
        filler = draw(st.sampled_from([0, 1]))
        lengths = [filler] * count
        for _ in range(min(count, draw(st.integers(0, 4)))):
            lengths[draw(st.integers(0, count - 1))] = draw(length_values)
    return limits, count, lengths


@fuzz(200)
@given(header=headers(), chunks=chunk_lists, seed=st.integers(0, U32_MAX))
# each limit, at it and just past it, is always tried
@example((LIMITS, 8, [0] * 8), [8192], 0)
@example((LIMITS, 9, [0] * 9), [8192], 0)
@example((LIMITS, U32_MAX, None), [8192], 0)
@example((LIMITS, 1, [4096]), [8192], 0)
@example((LIMITS, 1, [4097]), [8192], 0)
@example((LIMITS, 2, [1, U64_MAX]), [8192], 0)
@example((LIMITS, 4, [4096] * 4), [8192], 0)
@example((LIMITS, 5, [4096] * 4 + [1]), [8192], 0)
@example((OTHER_LIMITS[2], 600, [1] * 600), [8192], 0)
@example((OTHER_LIMITS[2], 601, [0] * 601), [8192], 0)
def test_header_limits(
    header: tuple[Limits, int, list[int] | None], chunks: list[int], seed: int
) -> None:
    limits, count, lengths = header
    allocator = CountingAllocator(limits)
    raw_header = struct.pack("!I", count) + (
        struct.pack(f"!{count}Q", *lengths) if lengths else b""
    )
    too_many = count > limits.max_frames
    too_large = lengths is not None and (
        any(n > limits.max_frame_size for n in lengths) or sum(lengths) > limits.max_message_size
    )
    # the header alone (no frame bytes, no EOF) is enough to decide
    out = decode(PREAMBLE + raw_header, chunks, limits=limits, allocator=allocator, eof=False)
    if too_many or too_large:
        assert out.end == "protocol"
        assert allocator.sizes == [], "memory allocated for a header over the limits"
        if too_many:
            # rejected on the count, before the length table is read
            count_only = decode(PREAMBLE + raw_header[:4], limits=limits, eof=False)
            assert count_only.end == "protocol"
        return
    assert lengths is not None
    if sum(lengths) == 0:
        assert out.messages == [[b""] * count]
    else:
        assert out.end == "" and out.messages == []  # waiting for the frames
    frames = [random.Random(seed + i).randbytes(n) for i, n in enumerate(lengths)]
    full = decode(PREAMBLE + raw_header + b"".join(frames), chunks, limits=limits)
    assert full.end == "eof", full.error
    assert full.messages == [frames]


# -- mutations of valid traffic ------------------------------------------------

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64_MAX)
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=100),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)

mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "insert", "delete", "length", "count"]),
        st.integers(0, 2**16),
        st.integers(0, 255),
        interesting_lengths,
    ),
    min_size=1,
    max_size=4,
)


def mutate(
    stream: bytes, fields: list[tuple[int, int]], ops: list[tuple[str, int, int, int]]
) -> tuple[bytes, int]:
    """Apply ``ops`` to ``stream``; return the result and the first changed offset.

    ``fields`` are the (offset, width) of the header fields, the targets of
    the "length" and "count" overwrites.
    """
    data = bytearray(stream)
    first = len(data)
    for op, where, byte, value in ops:
        if op in ("length", "count"):
            wanted = 8 if op == "length" else 4
            candidates = [(o, w) for o, w in fields if w == wanted and o + w <= len(data)]
            if not candidates:
                continue
            offset, width = candidates[where % len(candidates)]
            data[offset : offset + width] = (value % 2 ** (8 * width)).to_bytes(width, "big")
        elif op == "insert":
            offset = where % (len(data) + 1)
            data.insert(offset, byte)
        elif not data:
            continue
        elif op == "flip":
            offset = where % len(data)
            data[offset] ^= 1 << (byte % 8)
        else:
            offset = where % len(data)
            del data[offset]
        first = min(first, offset)
    return bytes(data), first


@fuzz(200)
@given(
    batch=st.lists(values, max_size=4),
    raw=st.lists(st.lists(st.binary(max_size=600), max_size=4), max_size=2),
    threshold=st.sampled_from([0, 16, 4096]),
    ops=mutations,
    chunks=chunk_lists,
)
def test_mutated_valid_traffic(
    batch: list[Any],
    raw: list[list[bytes]],
    threshold: int,
    ops: list[tuple[str, int, int, int]],
    chunks: list[int],
) -> None:
    serializer = Serializer(oob_threshold=threshold)
    messages = [[bytes(f) for f in serializer.dumps(value)] for value in batch]
    messages += raw
    assume(all(len(m) <= LIMITS.max_frames for m in messages))
    assume(all(sum(map(len, m)) <= LIMITS.max_message_size for m in messages))
    stream = PREAMBLE + encode_stream(messages)
    ends = boundaries(messages, len(PREAMBLE))
    fields: list[tuple[int, int]] = [(8, 2), (10, 2)]  # preamble version, body length
    fields += [(12, 4), (16, 8), (24, 8)]  # preamble limits
    for start, m in zip([len(PREAMBLE), *ends][: len(messages)], messages, strict=True):
        fields.append((start, 4))
        fields += [(start + 4 + 8 * k, 8) for k in range(len(m))]
    mutated, first = mutate(stream, fields, ops)

    allocator = CountingAllocator(LIMITS)
    out = decode(mutated, chunks, allocator=allocator)
    assert out.end in ("eof", "truncated", "protocol")
    assert out.summary() == decode(mutated).summary()
    # messages that ended before the first changed byte come out unchanged
    intact = [m for m, end in zip(messages, ends, strict=True) if end <= first]
    assert out.messages[: len(intact)] == intact
    # the message layer on top: whatever the decoder let through decodes or is
    # a RemoteProtocolError
    for frames in out.messages:
        try:
            serializer.loads([memoryview(bytearray(f)) for f in frames])
        except RemoteProtocolError:
            pass


# -- memory --------------------------------------------------------------------


@contextmanager
def traced() -> Iterator[None]:
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        yield
    finally:
        if started:
            tracemalloc.stop()


def peak_while(data: bytes, chunks: list[int], limits: Limits, read_buffer_size: int) -> int:
    """Extra memory at the peak of decoding ``data`` with the default allocator."""
    with traced():
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        decode(data, chunks, limits=limits, read_buffer_size=read_buffer_size, keep=False)
        return tracemalloc.get_traced_memory()[1] - base


#: headers a hostile peer sends to make the receiver allocate: counts and
#: lengths far past the limits, up to the largest the wire can carry
hostile_headers = st.one_of(
    st.builds(lambda n: struct.pack("!I", n), st.sampled_from([9, 600, 601, 2**20, U32_MAX])),
    st.builds(
        lambda lengths: encode_header(lengths),
        st.lists(
            st.sampled_from([4097, 16385, 2**20, 2**30, 2**40, U64_MAX]) | interesting_lengths,
            min_size=1,
            max_size=8,
        ),
    ),
)


@fuzz(30)
@given(
    limits=st.sampled_from([LIMITS, OTHER_LIMITS[2]]),
    valid=st.lists(st.sampled_from([0, 1, 2]), max_size=3),
    hostile=hostile_headers,
    tail=st.binary(max_size=64),
    chunks=chunk_lists,
    read_buffer_size=st.sampled_from(READ_BUFFER_SIZES),
)
# the largest messages back to back: one must be released before the next
@example(LIMITS, [0, 0, 0], struct.pack("!I", U32_MAX), b"", [8192], 4096)
@example(OTHER_LIMITS[2], [1, 1], encode_header([2**40]), b"", [8192], 4096)
def test_memory_is_bounded_by_the_limits(
    limits: Limits,
    valid: list[int],
    hostile: bytes,
    tail: bytes,
    chunks: list[int],
    read_buffer_size: int,
) -> None:
    # messages at the limits (the largest the peer may send), then a hostile header
    largest = [
        [b"\x01" * limits.max_frame_size] * (limits.max_message_size // limits.max_frame_size),
        [b"\x02"] * limits.max_frames,
        [b"\x03" * limits.max_frame_size] + [b""] * (limits.max_frames - 1),
    ]
    largest = [m for m in largest if sum(map(len, m)) <= limits.max_message_size]
    messages = [largest[i % len(largest)] for i in valid]
    data = PREAMBLE + encode_stream(messages) + hostile + tail
    peak = peak_while(data, chunks, limits, read_buffer_size)
    # one read-ahead buffer and one message, plus per frame its length (in the
    # table and as an int) and its buffer and view objects, plus a little
    # bookkeeping; a decoder that allocated what a hostile header announces,
    # or kept the previous message while receiving the next, exceeds it
    bound = read_buffer_size + limits.max_message_size + FRAME_OVERHEAD * limits.max_frames
    bound += 16 * 1024
    assert peak < bound, f"peak {peak} bytes > {bound}"


def test_memory_bound_catches_an_allocation_past_the_limits() -> None:
    """The tracemalloc measurement sees an allocation the allocator never saw."""

    def greedy(nbytes: int) -> bytearray:
        bytearray(1 << 20)  # a hidden 1 MiB allocation per frame
        return bytearray(nbytes)

    with traced():
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        decode(PREAMBLE + encode_stream([[b"x"]]), limits=LIMITS, allocator=greedy)
        peak = tracemalloc.get_traced_memory()[1] - base
    assert peak > 1 << 20


# -- Serializer.loads ----------------------------------------------------------

RAW = Serializer()


def loads(body: bytes, oob: Sequence[bytes] = (), serializer: Serializer = RAW) -> Any:
    frames = [memoryview(bytearray(body)), *(memoryview(bytearray(f)) for f in oob)]
    return serializer.loads(frames)


def ext(code: int, payload: bytes) -> bytes:
    """A msgpack extension value with any type code (-128..127) and payload."""
    size = len(payload)
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if size in fixed:
        head = bytes([fixed[size]])
    elif size < 2**8:
        head = bytes([0xC7, size])
    elif size < 2**16:
        head = b"\xc8" + struct.pack("!H", size)
    else:
        head = b"\xc9" + struct.pack("!I", size)
    return head + struct.pack("!b", code) + payload


def array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 + n])
    return b"\xdc" + struct.pack("!H", n) if n < 2**16 else b"\xdd" + struct.pack("!I", n)


@fuzz(300)
@given(body=st.binary(max_size=300), oob=st.lists(st.binary(max_size=20), max_size=3))
def test_loads_arbitrary_bodies(body: bytes, oob: list[bytes]) -> None:
    try:
        loads(body, oob)
    except RemoteProtocolError:
        pass


def test_loads_without_a_body_frame() -> None:
    with pytest.raises(RemoteProtocolError):
        RAW.loads([])


@st.composite
def hostile_items(draw: st.DrawFn, n_oob: int) -> tuple[bytes, object]:
    """One msgpack item and what it decodes to, or ``INVALID`` if it must be rejected."""
    kind = draw(
        st.sampled_from(
            [
                "plain",
                "oob",
                "oob-out-of-range",
                "oob-bad-size",
                "unknown-ext",
                "pickle",
                "timestamp",
            ]
        )
    )
    if kind == "plain":
        value = draw(st.integers(-(2**63), U64_MAX) | st.text(max_size=5) | st.none())
        return msgpack.packb(value), value
    if kind == "oob" and n_oob:
        index = draw(st.integers(0, n_oob - 1))
        return ext(EXT_OOB, struct.pack("!I", index)), ("oob", index)
    if kind in ("oob", "oob-out-of-range"):
        index = draw(
            st.sampled_from([n_oob, n_oob + 1, 2**31, U32_MAX]) | st.integers(n_oob, U32_MAX)
        )
        return ext(EXT_OOB, struct.pack("!I", index)), INVALID
    if kind == "oob-bad-size":
        size = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 16, 300]))
        return ext(EXT_OOB, bytes(size)), INVALID
    if kind == "unknown-ext":
        code = draw(st.integers(-128, 127).filter(lambda c: c not in (-1, EXT_OOB, EXT_PICKLE)))
        return ext(code, draw(st.binary(max_size=20))), INVALID
    if kind == "timestamp":
        seconds = draw(st.integers(0, U32_MAX))
        return ext(-1, struct.pack("!I", seconds)), msgpack.Timestamp(seconds)
    # pickle: valid-looking or malformed references; never unpickled here
    payload = draw(
        st.binary(max_size=20)
        | st.lists(st.integers(0, max(n_oob - 1, 0)), min_size=1, max_size=3).map(
            lambda ix: struct.pack(f"!{len(ix)}I", *ix)
        )
    )
    return ext(EXT_PICKLE, payload), INVALID


class _Invalid:
    def __repr__(self) -> str:
        return "INVALID"


INVALID = _Invalid()


def resolve(expected: object, oob: Sequence[bytes]) -> object:
    if isinstance(expected, tuple) and expected[:1] == ("oob",):
        return oob[expected[1]]
    return expected


def plain(value: object) -> object:
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


@fuzz(200)
@given(
    oob=st.lists(st.binary(max_size=16), max_size=3),
    data=st.data(),
    container=st.sampled_from(["array", "array32", "map"]),
    huge=st.none()
    | st.tuples(st.sampled_from([0xC6, 0xDB, 0xDD, 0xDF, 0xC9]), st.integers(1, U32_MAX)),
)
def test_loads_hostile_structures(
    oob: list[bytes],
    data: st.DataObject,
    container: str,
    huge: tuple[int, int] | None,
) -> None:
    """Extension values of every kind, in arrays and maps, optionally followed by a
    value whose declared length (up to 2**32 - 1) runs past the end of the body."""
    items = data.draw(st.lists(hostile_items(len(oob)), max_size=6))
    encoded = [item for item, _ in items]
    expected = [resolve(value, oob) for _, value in items]
    invalid = any(value is INVALID for value in expected)
    if huge is not None:
        type_byte, declared = huge
        encoded.append(bytes([type_byte]) + struct.pack("!I", declared))  # nothing follows
        invalid = True
    n = len(encoded)
    if container == "map":
        body = bytes([0x80 + n]) if n < 16 else b"\xde" + struct.pack("!H", n)
        body += b"".join(msgpack.packb(f"k{i}") + item for i, item in enumerate(encoded))
    else:
        head = array_header(n) if container == "array" else b"\xdd" + struct.pack("!I", n)
        body = head + b"".join(encoded)
    if invalid:
        with pytest.raises(RemoteProtocolError):
            loads(body, oob)
        return
    result = loads(body, oob)
    if container == "map":
        result = [result[f"k{i}"] for i in range(n)]
    assert plain(result) == expected


@fuzz(80)
@given(
    depth=st.sampled_from([1, 2, 1023, 1024, 1025, 1026, 5000, 100_000]) | st.integers(1, 3000),
    shape=st.sampled_from(["array", "map", "mixed"]),
    leaf=st.sampled_from(["nil", "oob", "bad-oob"]),
)
@example(1024, "mixed", "oob")
@example(1025, "array", "nil")
@example(1025, "map", "nil")
def test_depth_bombs(depth: int, shape: str, leaf: str) -> None:
    levels = [b"\x91", b"\x81\xa1k"]
    pattern = {"array": levels[:1], "map": levels[1:], "mixed": levels}[shape]
    body = b"".join(pattern[i % len(pattern)] for i in range(depth))
    leaves = {"nil": b"\xc0", "oob": ext(EXT_OOB, bytes(4)), "bad-oob": ext(EXT_OOB, b"\0\0\0\1")}
    body += leaves[leaf]
    if depth > 1024 or leaf == "bad-oob":  # the documented nesting limit is 1024
        with pytest.raises(RemoteProtocolError):
            loads(body, [b"leaf"])
        return
    value = loads(body, [b"leaf"])
    for i in range(depth):
        value = value[0] if pattern[i % len(pattern)] == b"\x91" else value["k"]
    assert plain(value) == (None if leaf == "nil" else b"leaf")


@fuzz(60)
@given(
    declared=st.sampled_from([2**16, 2**31, U32_MAX]) | st.integers(17, U32_MAX),
    type_byte=st.sampled_from([0xC6, 0xDB, 0xDD, 0xDF, 0xC9]),
    present=st.integers(0, 16),
)
def test_huge_declared_lengths(declared: int, type_byte: int, present: int) -> None:
    """A 4 GiB declared length is refused on the lengths that are there, without
    allocating what was announced (a 2**32 element list would need 32 GiB)."""
    body = bytes([type_byte]) + struct.pack("!I", declared) + b"\xc0" * present
    with traced():
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with pytest.raises(RemoteProtocolError):
            loads(body)
        peak = tracemalloc.get_traced_memory()[1] - base
    assert peak < 64 * 1024


# -- pickle without opt-in ------------------------------------------------------

#: what unpickling a Detonator did; empty unless something was unpickled
UNPICKLED: list[str] = []


def record_unpickling(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class Detonator:
    """Unpickling this calls record_unpickling: the side effect tells that it happened."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return record_unpickling, ("unpickled",)


def test_pickle_payload_runs_when_opted_in() -> None:
    """Positive control: the payload used below really executes when unpickled."""
    trusting = Serializer(allow_pickle=True)
    frames = trusting.dumps({"x": Detonator()})
    UNPICKLED.clear()
    assert trusting.loads([memoryview(bytearray(f)) for f in frames]) == {"x": "unpickled"}
    assert UNPICKLED == ["unpickled"]
    UNPICKLED.clear()


@fuzz(100)
@given(
    wrapper=st.sampled_from(["top", "array", "map-value", "map-key", "after-oob", "nested"]),
    indices=st.sampled_from([[0], [0, 0], [1, 0], [0, 7], [U32_MAX]])
    | st.lists(st.integers(0, 3), min_size=1, max_size=4),
    extra_frames=st.integers(0, 2),
    junk=st.binary(max_size=8),
)
def test_pickle_is_never_unpickled_without_opt_in(
    wrapper: str, indices: list[int], extra_frames: int, junk: bytes
) -> None:
    stream = pickle.dumps(Detonator(), protocol=5)
    pickled = ext(EXT_PICKLE, struct.pack(f"!{len(indices)}I", *indices))
    body = {
        "top": pickled,
        "array": b"\x92\x01" + pickled,
        "map-value": b"\x81\xa1k" + pickled,
        "map-key": b"\x81" + pickled + b"\xc0",
        "after-oob": b"\x92" + ext(EXT_OOB, bytes(4)) + pickled,
        "nested": b"\x91" * 50 + b"\x81\xa1k" + pickled,
    }[wrapper]
    oob = [stream, *([stream] * extra_frames)]
    UNPICKLED.clear()
    with pytest.raises(RemoteProtocolError, match="pickle"):
        loads(body + junk, oob, Serializer(allow_pickle=False))
    assert UNPICKLED == []
    # what a trusting sender produces is refused just the same
    frames = Serializer(allow_pickle=True).dumps([Detonator(), b"x" * 5000])
    with pytest.raises(RemoteProtocolError, match="pickle"):
        Serializer().loads([memoryview(bytearray(f)) for f in frames])
    assert UNPICKLED == []
