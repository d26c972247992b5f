"""Wire helpers: header layout, limits, iovec coalescing."""

from __future__ import annotations

import pytest

from anyio_comm import Limits, LocalProtocolError
from anyio_comm._sansio.wire import (
    COALESCE_THRESHOLD,
    encode_frames,
    encode_header,
    frames_to_iov,
)


def test_header_is_big_endian() -> None:
    assert encode_header([5]) == b"\x00\x00\x00\x01" + b"\x00" * 7 + b"\x05"
    assert encode_header([]) == b"\x00\x00\x00\x00"
    assert encode_header([1, 2**64 - 1]) == (
        b"\x00\x00\x00\x02" + (1).to_bytes(8, "big") + b"\xff" * 8
    )


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_frames": -1}, ValueError),
        ({"max_frames": 2**32}, ValueError),
        ({"max_frame_size": 2**64}, ValueError),
        ({"max_message_size": 1.5}, TypeError),
        ({"max_frames": True}, TypeError),
    ],
)
def test_limits_validation(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        Limits(**kwargs)  # type: ignore[arg-type]


def test_check_send() -> None:
    limits = Limits(max_frames=2, max_frame_size=10, max_message_size=15)
    limits.check_send([10, 5])
    limits.check_send([])
    with pytest.raises(LocalProtocolError, match="3 frames"):
        limits.check_send([1, 1, 1])
    with pytest.raises(LocalProtocolError, match="per frame"):
        limits.check_send([11])
    with pytest.raises(LocalProtocolError, match="per message"):
        limits.check_send([10, 6])


def test_iov_coalesces_small_and_passes_large_through() -> None:
    small = [memoryview(b"a" * 10), memoryview(b"b" * 20)]
    large = memoryview(bytearray(COALESCE_THRESHOLD))
    iov = frames_to_iov(b"HDR", [*small, large, memoryview(b""), memoryview(b"z")])
    assert len(iov) == 3
    assert iov[0] == b"HDR" + b"a" * 10 + b"b" * 20
    assert iov[1] is large  # never copied
    assert iov[2] == b"z"


@pytest.mark.parametrize(
    "lengths",
    [
        [0, COALESCE_THRESHOLD],
        [COALESCE_THRESHOLD - 1, COALESCE_THRESHOLD],
        [5, 100_000],
        [5, 10],
        [COALESCE_THRESHOLD, 5],
        [COALESCE_THRESHOLD, COALESCE_THRESHOLD],
        [5, COALESCE_THRESHOLD, 7],
    ],
)
def test_encode_frames_sends_the_bytes_of_header_and_frames(lengths: list[int]) -> None:
    """Whatever the shape (the body and one large frame has a shortcut), the
    gather write holds the header and the frames, a large frame passed through."""
    frames = [memoryview(bytes([i + 1]) * n) for i, n in enumerate(lengths)]
    iov = encode_frames(frames, lengths)
    assert b"".join(iov) == encode_header(lengths) + b"".join(frames)
    assert iov == frames_to_iov(encode_header(lengths), frames)
    for frame in frames:
        if frame.nbytes >= COALESCE_THRESHOLD:
            assert any(buffer is frame for buffer in iov)


def test_iov_single_header() -> None:
    assert frames_to_iov(b"HDR", []) == [b"HDR"]
