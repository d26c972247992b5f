"""The comparison's framing (``benchmarks.systems.framing``): the floors' parser,
with and without reusing frame buffers (``floor-blocking-reuse``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from benchmarks.systems.framing import SCRATCH_SIZE, FrameReader, outgoing, pack_header

if TYPE_CHECKING:
    from collections.abc import Iterator


def _messages(reader: FrameReader, data: bytes, step: int) -> Iterator[tuple[bytes, list[Any]]]:
    """Feed ``data`` to ``reader`` ``step`` bytes at most at a time; yield each message
    as soon as it is returned (before any later byte is written)."""
    view = memoryview(data)
    while view:
        buffer = reader.get_buffer()
        n = min(step, len(buffer), len(view))
        buffer[:n] = view[:n]
        view = view[n:]
        yield from reader.buffer_updated(n)


def _feed(reader: FrameReader, data: bytes, step: int) -> list[tuple[bytes, list[Any]]]:
    return list(_messages(reader, data, step))


def _message(sizes: list[int], fill: int) -> tuple[list[bytes], bytes]:
    frames = [bytes([fill + i]) * n for i, n in enumerate(sizes)]
    return frames, b"".join(outgoing(pack_header(frames), frames))


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("step", [1000, 70_000, 10**7])
def test_messages_come_back_whole(reuse: bool, step: int) -> None:
    reader = FrameReader(reuse=reuse)
    for fill in range(3):
        frames, wire = _message([10, 3 * SCRATCH_SIZE, 200_000], fill)
        [(header, got)] = _feed(reader, wire, step)
        assert header == pack_header(frames)
        assert [bytes(f) for f in got] == frames


def test_reuse_gives_the_same_buffer_for_the_same_place_and_length() -> None:
    reader = FrameReader(reuse=True)
    firsts = _feed(reader, _message([300_000, 300_000], 0)[1], 65536)[0][1]
    seconds = _feed(reader, _message([300_000, 300_000], 5)[1], 65536)[0][1]
    assert firsts[0] is seconds[0] and firsts[1] is seconds[1]
    assert firsts[0] is not firsts[1]
    assert bytes(seconds[1]) == bytes([6]) * 300_000
    other = _feed(reader, _message([300_001, 300_000], 9)[1], 65536)[0][1]
    assert other[0] is not firsts[0] and other[1] is firsts[1]


def test_without_reuse_every_large_frame_is_new() -> None:
    reader = FrameReader()
    firsts = _feed(reader, _message([300_000], 0)[1], 65536)[0][1]
    seconds = _feed(reader, _message([300_000], 1)[1], 65536)[0][1]
    assert firsts[0] is not seconds[0]
    assert bytes(firsts[0]) == bytes([0]) * 300_000


@pytest.mark.parametrize("step", [4096, 65536, 10**7])
def test_reuse_never_writes_into_a_message_before_it_is_returned(step: int) -> None:
    # The floors' echo relies on it: a message holding reused buffers is returned
    # before any byte of the next one is written into them (checked at each return).
    reader = FrameReader(reuse=True)
    messages = [_message([300_000, 20, 200_000], fill) for fill in range(0, 40, 10)]
    stream = b"".join(wire for _, wire in messages)
    expected = [frames for frames, _ in messages]
    # strict: as many messages come back as were sent
    for (_, got), frames in zip(_messages(reader, stream, step), expected, strict=True):
        assert [bytes(f) for f in got] == frames
