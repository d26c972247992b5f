"""Connection without an event loop: two peers wired back to back (h11's ConnectionPair)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from anyio_comm import CloseCode, CloseReason, Limits, LocalProtocolError, RemoteProtocolError
from anyio_comm._sansio.connection import Connection, ConnectionState, EndOfData
from anyio_comm._sansio.wire import encode_header

from ..decoding import receive_into

if TYPE_CHECKING:
    from anyio_comm._sansio.budget import BudgetAccount

OPEN, CLOSED, ERROR, HANDSHAKE = (
    ConnectionState.OPEN,
    ConnectionState.CLOSED,
    ConnectionState.ERROR,
    ConnectionState.HANDSHAKE,
)


def deliver(receiver: Connection, data: bytes) -> list[list[bytes]]:
    """Write ``data`` into ``receiver`` through get_buffer/buffer_updated, as recv_into
    does, draining complete messages after each write (once the peer's preamble was
    parsed); return them."""
    messages: list[list[bytes]] = []
    view = memoryview(data)
    while view:
        view = receive_into(receiver, view)
        if receiver.peer is not None:
            while (message := receiver.next_message()) is not None:
                messages.append([bytes(f) for f in message])
    return messages


def joined(buffers: list[object]) -> bytes:
    return b"".join(bytes(memoryview(b)) for b in buffers)  # type: ignore[arg-type]


class Pair:
    """Two connections after the preamble exchange."""

    def __init__(
        self,
        a_limits: Limits | None = None,
        b_limits: Limits | None = None,
        *,
        b_account: BudgetAccount | None = None,
    ) -> None:
        self.a = Connection(a_limits)
        self.b = Connection(b_limits, account=b_account)
        deliver(self.b, self.a.preamble())
        deliver(self.a, self.b.preamble())
        assert self.a.next_handshake() is not None
        assert self.b.next_handshake() is not None

    def send(self, frames: list[bytes]) -> list[bytes]:
        """Send ``frames`` from a to b; return the one message b decodes."""
        (message,) = deliver(self.b, joined(self.a.send_message([memoryview(f) for f in frames])))
        return message


def test_preamble_exchange_sets_the_peer_and_the_states() -> None:
    a, b = Connection(Limits(max_frames=7)), Connection()
    assert a.peer is None
    assert (a.our_state, a.their_state) == (OPEN, HANDSHAKE)
    preamble = a.preamble()
    deliver(b, preamble[:5])
    assert b.next_handshake() is None
    assert b.their_state is HANDSHAKE
    deliver(b, preamble[5:])
    handshake = b.next_handshake()
    assert handshake is not None and handshake.limits.max_frames == 7
    assert b.peer == handshake
    assert b.their_state is OPEN


@pytest.mark.parametrize(
    "frames", [[b"x"], [], [b""], [b"a" * 5000], [b"a", b"b" * 3000, b""], [b"z" * 70_000]]
)
def test_messages_travel_intact(frames: list[bytes]) -> None:
    assert Pair().send(frames) == frames


def test_sending_before_the_handshake_is_refused() -> None:
    a = Connection()
    with pytest.raises(LocalProtocolError, match="preamble"):
        a.send_message([memoryview(b"x")])


def test_sending_over_the_peers_limits_changes_nothing() -> None:
    pair = Pair(b_limits=Limits(max_frames=2, max_frame_size=100, max_message_size=150))
    for frames in ([b"x" * 101], [b"x"] * 3, [b"x" * 80, b"y" * 80]):
        with pytest.raises(LocalProtocolError):
            pair.a.send_message([memoryview(f) for f in frames])
    assert pair.a.our_state is OPEN
    assert pair.send([b"x" * 100]) == [b"x" * 100]  # still usable


def test_check_send_checks_what_send_message_would() -> None:
    """check_send() refuses exactly the messages send_message() refuses, and
    checks nothing before the peer's limits are known."""
    assert Connection().check_send([memoryview(b"x" * 10**6)]) is None  # no peer yet
    pair = Pair(b_limits=Limits(max_frames=2, max_frame_size=100, max_message_size=150))
    for frames in ([b"x" * 101], [b"x"] * 3, [b"x" * 80, b"y" * 80]):
        views = [memoryview(f) for f in frames]
        with pytest.raises(LocalProtocolError):
            pair.a.check_send(views)
        with pytest.raises(LocalProtocolError):
            pair.a.send_message(views)
    for frames in ([b"x" * 100], [b"x", b"y"], [b"x" * 75, b"y" * 75]):
        pair.a.check_send([memoryview(f) for f in frames])
        assert pair.send(frames) == frames


def test_send_eof_then_sending_is_refused() -> None:
    pair = Pair()
    pair.a.send_eof()
    assert pair.a.our_state is CLOSED
    with pytest.raises(LocalProtocolError, match="send_eof"):
        pair.a.send_message([memoryview(b"x")])
    pair.a.send_eof()  # again: no change
    assert pair.a.our_state is CLOSED


def test_send_failed_is_final() -> None:
    pair = Pair()
    pair.a.send_failed()
    assert pair.a.our_state is ERROR
    with pytest.raises(LocalProtocolError, match="failed"):
        pair.a.send_message([memoryview(b"x")])
    with pytest.raises(LocalProtocolError):
        pair.a.send_eof()
    assert pair.a.our_state is ERROR


def test_clean_eof_closes_their_side_and_is_repeated() -> None:
    pair = Pair()
    assert pair.send([b"last"]) == [b"last"]
    pair.b.receive_eof()
    for _ in range(3):
        with pytest.raises(EndOfData) as info:
            pair.b.next_message()
        assert not info.value.truncated
    assert pair.b.their_state is CLOSED


def test_eof_inside_a_message_is_an_error() -> None:
    pair = Pair()
    assert deliver(pair.b, joined(pair.a.send_message([memoryview(b"x" * 50)]))[:20]) == []
    assert pair.b.next_message() is None
    pair.b.receive_eof()
    for _ in range(2):
        with pytest.raises(EndOfData) as info:
            pair.b.next_message()
        assert info.value.truncated
    assert pair.b.their_state is ERROR


def test_protocol_error_is_sticky_and_the_payload_is_never_parsed() -> None:
    """A frame over the limit is refused; the bytes after its header, which here form a
    perfectly valid message, must never be parsed as one."""
    pair = Pair(b_limits=Limits(max_frame_size=10))
    smuggled = encode_header([3]) + b"abc"
    with pytest.raises(RemoteProtocolError, match="limit"):
        deliver(pair.b, encode_header([100]) + smuggled)
    first = None
    for _ in range(3):
        with pytest.raises(RemoteProtocolError, match="limit") as info:
            pair.b.next_message()
        assert info.value is not first  # a fresh exception each time
        first = info.value
    assert pair.b.their_state is ERROR
    with pytest.raises(RemoteProtocolError, match="limit"):  # more bytes change nothing
        deliver(pair.b, smuggled)
    with pytest.raises(RemoteProtocolError, match="limit"):
        pair.b.next_message()


def test_bad_preamble_is_sticky() -> None:
    b = Connection()
    deliver(b, b"GET / HTTP/1.1\r\n")
    for _ in range(2):
        with pytest.raises(RemoteProtocolError, match="magic"):
            b.next_handshake()
    with pytest.raises(RemoteProtocolError, match="magic"):
        b.next_message()
    assert b.their_state is ERROR
    assert b.peer is None


def test_receive_data_is_the_copying_path() -> None:
    a, b = Connection(), Connection()
    b.receive_data(a.preamble())
    assert b.next_handshake() is not None
    deliver(a, b.preamble())
    assert a.next_handshake() is not None
    b.receive_data(joined(a.send_message([memoryview(b"hello")])))  # copied in, not drained
    message = b.next_message()
    assert message is not None and [bytes(f) for f in message] == [b"hello"]


def test_next_message_before_the_handshake_is_a_usage_error() -> None:
    with pytest.raises(RuntimeError, match="next_handshake"):
        Connection().next_message()


class HugeFrame:
    """Stands for a frame of ``nbytes`` bytes (2**56 of them cannot be allocated): the
    size checks read only ``nbytes`` and ``len()``."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes


HUGE = 2**56  # the first frame length whose top byte a version-2 receiver may read as a codec
WIDE = Limits(max_frame_size=2**64 - 1, max_message_size=2**64 - 1)


@pytest.mark.parametrize("compression", [(), ("lz4",)], ids=["plain", "compressing"])
def test_no_frame_of_2_to_the_56_bytes_to_a_version_2_peer(compression: tuple[str, ...]) -> None:
    """Spec 6.1: a version-2 peer whose limits allow it still gets no frame of 2**56 bytes
    or more (whether it reads a codec byte in each length is not the sender's to guess);
    the message is refused before anything is sent, and the connection stays usable."""
    if compression:
        pytest.importorskip("cramjam")
    a = Connection(compression=compression)
    b = Connection(WIDE, compression=compression)
    deliver(b, a.preamble())
    deliver(a, b.preamble())
    assert a.next_handshake() is not None
    frames = [HugeFrame(HUGE)]
    with pytest.raises(LocalProtocolError, match=str(HUGE - 1)):
        a.check_send(frames)  # type: ignore[list-item]
    with pytest.raises(LocalProtocolError, match=str(HUGE - 1)):
        a.send_message(frames)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError):
        a.send_message([memoryview(b"x"), HugeFrame(HUGE)])  # type: ignore[list-item]
    a.check_send([HugeFrame(HUGE - 1)])  # type: ignore[list-item]
    assert a.our_state is OPEN


def test_a_version_1_peer_takes_frames_of_any_64_bit_length() -> None:
    a = Connection()
    b = Connection(WIDE, version=1)
    deliver(b, a.preamble())
    deliver(a, b.preamble())
    assert a.next_handshake() is not None
    huge = HugeFrame(2**63)
    a.check_send([huge])  # type: ignore[list-item]
    header, frame = a.send_message([huge])  # type: ignore[list-item]
    assert bytes(header) == encode_header([2**63]) and frame is huge


def test_early_data_carries_no_frame_of_2_to_the_56_bytes() -> None:
    """Spec 4.8: before the peer's preamble the sender cannot know whether the peer
    reads a codec byte in each length, so a connection that may be version 2 refuses
    such a frame; one of version 1 only does not."""
    a = Connection()
    a.send_early()
    with pytest.raises(LocalProtocolError, match="early data"):
        a.send_message([HugeFrame(HUGE)])  # type: ignore[list-item]
    assert a.our_state is OPEN
    assert len(a.send_message([HugeFrame(HUGE - 1)])) == 2  # type: ignore[list-item]
    v1 = Connection(version=1)
    v1.send_early()
    assert len(v1.send_message([HugeFrame(HUGE)])) == 2  # type: ignore[list-item]


@pytest.mark.parametrize(
    "shapes",
    [
        [[1]],
        [[0], [], [10, 20]],
        [[5000] * 3, [20] * 40],
        [[70_000], [3, 300_000]],
    ],
)
def test_the_counters_match_the_bytes_on_the_wire(shapes: list[list[int]]) -> None:
    """Without an event loop: the sender's and the receiver's counters agree with
    the bytes that went between them, the preambles and a close record included."""
    pair = Pair()
    sent = pair.a.sent_counters()[0]  # the preamble
    assert sent == pair.b.received_counters()[0] > 0
    for shape in shapes:
        frames = [bytes(n) for n in shape]
        data = joined(pair.a.send_message([memoryview(f) for f in frames]))
        sent += len(data)
        assert deliver(pair.b, data) == [frames]
    record = pair.a.close_record(CloseReason(CloseCode.NORMAL))
    sent += len(record)
    with pytest.raises(EndOfData):
        deliver(pair.b, record)
        pair.b.next_message()
    received = pair.b.received_counters()
    assert pair.a.sent_counters()[:4] == received[:4]
    assert received[0] == sent
    assert received[1] == len(shapes)
    assert received[1] + received[2] == sum(map(len, shapes))
    assert received[3] == max(sum(shape) for shape in shapes)


@pytest.mark.parametrize(
    "shapes",
    [[[10]], [[10], [5000]], [[3, 4], [2000]], [[1], [1, 2, 3]], [[]], [[100_000]]],
)
def test_unsend_last_takes_back_exactly_the_last_message(shapes: list[list[int]]) -> None:
    """Counts after sending ``shapes[:-1]`` equal those after sending all of them
    and taking the last back (the largest message included)."""
    pair = Pair()
    for shape in shapes[:-1]:
        pair.a.send_message([memoryview(bytes(n)) for n in shape])
    before = pair.a.sent_counters()
    last = [memoryview(bytes(n)) for n in shapes[-1]]
    pair.a.send_message(last)
    assert pair.a.sent_counters() != before
    pair.a.unsend_last(last)
    assert pair.a.sent_counters() == before
