"""Hypothesis: any message, cut into any chunks, round-trips through encoder and decoder."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from anyio_comm import Limits
from anyio_comm._sansio.decoder import FrameDecoder
from anyio_comm._sansio.serialization import Serializer
from anyio_comm._sansio.wire import encode_header, encode_preamble, frames_to_iov

from ..decoding import normalize, receive_into

frame_lists = st.lists(st.lists(st.binary(max_size=3000), max_size=6), min_size=1, max_size=6)

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=300),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in [*points, len(data)]:
        pieces.append(data[last:p])
        last = p
    return pieces


def decode_all(data: bytes, cuts: list[int], read_buffer_size: int) -> list[list[bytes]]:
    d = FrameDecoder(read_buffer_size=read_buffer_size)
    out: list[list[bytes]] = []
    handshake = None
    for piece in chunked(data, cuts):
        view = memoryview(piece)
        while view:
            view = receive_into(d, view)
            if handshake is None:
                handshake = d.next_handshake()
                if handshake is None:
                    continue
            while (frames := d.next_message()) is not None:
                out.append([bytes(f) for f in frames])
    return out


@settings(max_examples=300, deadline=None)
@given(
    messages=frame_lists,
    cuts=st.lists(st.integers(min_value=0), max_size=30),
    read_buffer_size=st.sampled_from([4096, 8192, 65536]),
)
def test_frames_roundtrip_any_chunking(messages, cuts, read_buffer_size) -> None:
    stream = encode_preamble(Limits()) + b"".join(
        b"".join(
            bytes(b)
            for b in frames_to_iov(encode_header([len(f) for f in m]), [memoryview(f) for f in m])
        )
        for m in messages
    )
    assert decode_all(stream, cuts, read_buffer_size) == messages


@settings(max_examples=300, deadline=None)
@given(message=values, threshold=st.sampled_from([0, 16, 4096]))
def test_messages_roundtrip(message, threshold) -> None:
    s = Serializer(oob_threshold=threshold)
    frames = s.dumps(message)
    out = s.loads([memoryview(bytearray(f)) for f in frames])
    assert normalize(out) == normalize(message)
