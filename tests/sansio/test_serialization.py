"""Serializer: msgpack body, out-of-band frames, pickle opt-in, hostile input."""

from __future__ import annotations

import collections
import pickle
import struct
import sys

import msgpack
import pytest

from anyio_comm import RemoteProtocolError, SerializationError
from anyio_comm._sansio.serialization import EXT_OOB, EXT_PICKLE, MAX_DEPTH, Serializer


def roundtrip(serializer: Serializer, message: object) -> object:
    frames = serializer.dumps(message)
    # simulate the wire: every frame lands in its own fresh buffer
    return serializer.loads([memoryview(bytearray(f)) for f in frames])


def test_plain_types_roundtrip() -> None:
    s = Serializer()
    message = {
        "s": "héllo",
        "i": -(2**63),
        "u": 2**64 - 1,
        "f": 1.5,
        "b": True,
        "n": None,
        "l": [1, [2, {"x": b"y"}]],
        "t": (1, 2),
    }
    expected = dict(message, t=[1, 2])
    assert roundtrip(s, message) == expected


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview, pickle.PickleBuffer])
def test_large_buffers_go_out_of_band(kind: type) -> None:
    s = Serializer(oob_threshold=100)
    data = bytes(range(200))
    value = kind(bytearray(data)) if kind is not bytes else data
    frames = s.dumps(
        {"k": value, "small": kind(bytearray(b"abc")) if kind is not bytes else b"abc"}
    )
    assert len(frames) == 2
    assert frames[1].obj is (
        value.raw().obj
        if kind is pickle.PickleBuffer
        else (value.obj if kind is memoryview else value)
    )  # zero-copy
    assert len(frames[0]) < 40  # the body holds a reference, not the data
    out = s.loads(frames)
    assert isinstance(out["k"], memoryview)
    assert bytes(out["k"]) == data
    assert out["small"] == b"abc" and type(out["small"]) is bytes


def test_threshold_is_inclusive() -> None:
    s = Serializer(oob_threshold=10)
    assert len(s.dumps(b"x" * 10)) == 2
    assert len(s.dumps(b"x" * 9)) == 1


def test_multidimensional_and_noncontiguous_buffers() -> None:
    s = Serializer(oob_threshold=4)
    two_d = memoryview(bytearray(range(16))).cast("B", (4, 4))
    assert bytes(roundtrip(s, two_d)) == bytes(range(16))  # type: ignore[arg-type]
    strided = memoryview(bytearray(range(32)))[::2]
    assert bytes(roundtrip(s, strided)) == bytes(range(0, 32, 2))  # type: ignore[arg-type]


def test_messages_without_buffers_are_not_rebuilt() -> None:
    s = Serializer()
    message = {"a": [1, 2, {"b": "c"}]}
    frames = s.dumps(message)
    assert frames[0].tobytes() == msgpack.packb(message)


@pytest.mark.parametrize("value", [{1, 2}, object(), 2**64, complex(1, 2)])
def test_unsupported_types_raise_serialization_error(value: object) -> None:
    with pytest.raises(SerializationError) as info:
        Serializer().dumps({"v": value})
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (2**64, "int 18446744073709551616"),
        (-(2**63) - 1, "int -9223372036854775809"),
        (-(2**100), f"int {-(2**100)}"),
        (10**5000, "int of 16610 bits"),  # too long to print whole
    ],
    ids=["2**64", "-2**63-1", "-2**100", "10**5000"],
)
@pytest.mark.parametrize("peer_accepts_pickle", [True, False])
def test_int_out_of_range_says_so(value: int, shown: str, peer_accepts_pickle: bool) -> None:
    """Not "cannot serialize object of type 'int'": the value and msgpack's range."""
    s = Serializer(allow_pickle=not peer_accepts_pickle, peer_accepts_pickle=peer_accepts_pickle)
    with pytest.raises(SerializationError) as info:
        s.dumps({"v": [1, value]})
    message = str(info.value)
    assert message.startswith(f"{shown} is out of msgpack's range [-2**63, 2**64-1]"), message
    assert ("the peer does not accept pickled objects" in message) is not peer_accepts_pickle
    # the limits themselves are in range
    assert roundtrip(s, [2**64 - 1, -(2**63)]) == [2**64 - 1, -(2**63)]


def test_int_out_of_range_travels_pickled_when_pickle_is_on() -> None:
    s = Serializer(allow_pickle=True)
    assert roundtrip(s, {"v": 2**64}) == {"v": 2**64}


def test_deep_nesting_raises_serialization_error() -> None:
    message: object = []
    for _ in range(2000):
        message = [message]
    with pytest.raises(SerializationError):
        Serializer().dumps(message)


def test_pickle_opt_in_roundtrip_with_out_of_band_buffers() -> None:
    s = Serializer(allow_pickle=True, oob_threshold=100)
    big = bytearray(b"q" * 1000)
    message = {"set": {1, 2}, "obj": [pickle.PickleBuffer(big), complex(1, 2)]}
    frames = s.dumps(message)
    out = roundtrip(s, message)
    assert out["set"] == {1, 2}  # type: ignore[index]
    assert bytes(out["obj"][0]) == bytes(big)  # type: ignore[index]
    assert out["obj"][1] == complex(1, 2)  # type: ignore[index]
    assert any(f.obj is big for f in frames)


def test_pickled_data_refused_without_opt_in() -> None:
    frames = Serializer(allow_pickle=True).dumps({1, 2})
    with pytest.raises(RemoteProtocolError, match="pickle is not enabled"):
        Serializer().loads(frames)


def body(obj: object) -> list[memoryview]:
    return [memoryview(msgpack.packb(obj, use_bin_type=True))]


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "no body"),
        ([memoryview(b"\xc1")], "malformed"),  # never-used msgpack byte
        ([memoryview(b"\x92\x01")], "malformed"),  # truncated array
        ([memoryview(b"\x01\x02")], "malformed"),  # trailing data
        (body(msgpack.ExtType(42, b"")), "unknown msgpack extension type 42"),
        (body(msgpack.ExtType(EXT_OOB, struct.pack("!I", 0))), "out-of-band reference 0"),
        (body(msgpack.ExtType(EXT_OOB, b"\x00")), "malformed out-of-band"),
        (body(msgpack.ExtType(EXT_PICKLE, b"\x00\x00\x00\x00")), "pickle is not enabled"),
        (body({1: 2}), "malformed"),  # non-str key (strict_map_key)
        ([memoryview(b"\xa2\xff\xfe")], "malformed"),  # invalid UTF-8
    ],
)
def test_hostile_bodies_raise_remote_protocol_error(frames: list[memoryview], match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        Serializer().loads(frames)


@pytest.mark.parametrize(
    "frame",
    [
        b"\x00" * 2**20,  # a value (0), then a MiB of trailing bytes
        b"\xa4\xff" + b"\x1b[2J" * 2**18,  # invalid UTF-8 in a string, then more
        b"\xc1\x00\x1b]0;title\x07",  # a never-used byte, then terminal escapes
    ],
)
def test_a_malformed_body_is_described_briefly(frame: bytes) -> None:
    """The error says what is wrong in a line: it quotes none of the body's bytes
    (a MiB of zeros would make a repr of 4 MiB), holds no copy of them (the
    trailing bytes msgpack copies into its own exception are not chained), and
    has no control characters."""
    with pytest.raises(RemoteProtocolError, match="malformed message body") as info:
        Serializer().loads([memoryview(frame)])
    text = str(info.value)
    assert len(text) < 400
    assert text.isprintable()
    assert not isinstance(info.value.__cause__, msgpack.ExtraData)
    assert not isinstance(info.value.__context__, msgpack.ExtraData)


def test_a_large_body_decodes_as_a_small_one() -> None:
    """A body of a MiB and more is decoded a chunk at a time: the same values,
    strings and out-of-band references crossing the chunks' edges included."""
    from anyio_comm._sansio.serialization import CHUNKED_BODY

    s = Serializer()
    value = {
        "rows": [list(range(50)) for _ in range(4000)],
        "text": ["é" * 1000 + str(i) for i in range(600)],
        "blob": b"\x01" * 100_000,  # out-of-band
        "big": "x" * (3 * CHUNKED_BODY),  # one string over several chunks
    }
    frames = [memoryview(f) for f in s.dumps(value)]
    assert frames[0].nbytes > 4 * CHUNKED_BODY
    assert s.loads(frames) == value
    with pytest.raises(RemoteProtocolError, match="malformed message body: 3 bytes after"):
        s.loads([memoryview(bytes(frames[0]) + b"\x01\x02\x03"), *frames[1:]])
    with pytest.raises(RemoteProtocolError, match="malformed message body"):
        s.loads([frames[0][:-1], *frames[1:]])  # truncated


def test_bad_pickle_is_remote_protocol_error() -> None:
    s = Serializer(allow_pickle=True)
    frames = [*body(msgpack.ExtType(EXT_PICKLE, struct.pack("!I", 0))), memoryview(b"garbage")]
    with pytest.raises(RemoteProtocolError, match="cannot unpickle"):
        s.loads(frames)
    with pytest.raises(RemoteProtocolError, match="malformed pickle"):
        s.loads(body(msgpack.ExtType(EXT_PICKLE, b"\x00\x00")))


def test_threshold_validation() -> None:
    with pytest.raises(ValueError, match="oob_threshold"):
        Serializer(oob_threshold=-1)


@pytest.mark.parametrize("key", [1, 1.5, None, (1, 2)])
def test_non_string_keys_refused_at_send_time(key: object) -> None:
    with pytest.raises(SerializationError, match="map keys"):
        Serializer().dumps({"outer": {key: 1}})


class Dict(dict):  # type: ignore[type-arg]
    pass


class List(list):  # type: ignore[type-arg]
    pass


Pair = collections.namedtuple("Pair", "first second")


@pytest.mark.parametrize(
    "message",
    [
        Dict({1: 2}),
        {"a": Dict({1: 2})},
        [List([{1: 2}])],
        Pair({1: 2}, None),
        {"a": collections.OrderedDict([(1, 2)])},
    ],
    ids=["dict-subclass", "nested-dict-subclass", "list-subclass", "namedtuple", "ordered-dict"],
)
def test_keys_inside_container_subclasses_refused_at_send_time(message: object) -> None:
    # msgpack packs these as maps and arrays: a receiver would refuse the key.
    with pytest.raises(SerializationError, match="map keys"):
        Serializer().dumps(message)


def test_container_subclasses_are_walked_for_buffers() -> None:
    s = Serializer(oob_threshold=10)
    big = b"x" * 10
    message = {"p": Pair(big, Dict(b=List([big])))}
    frames = s.dumps(message)
    assert len(frames) == 3
    out = s.loads(frames)
    assert out == {"p": [big, {"b": [big]}]}
    assert isinstance(out["p"][0], memoryview)


def nested(depth: int) -> object:
    """Lists nested ``depth`` deep, the innermost empty."""
    message: object = []
    for _ in range(depth - 1):
        message = [message]
    return message


def nesting(value: object) -> int:
    """How deep lists of one element are nested in ``value``, the innermost empty."""
    depth = 0
    while value != []:
        assert isinstance(value, list)
        (value,) = value
        depth += 1
    return depth + 1


def test_sender_refuses_a_body_nested_deeper_than_the_receivers_accept() -> None:
    # With Python's recursion limit raised, msgpack's packer (1.2 and later)
    # would encode 1025 nested containers: the serializer refuses them itself.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(MAX_DEPTH + 1000)
    try:
        with pytest.raises(SerializationError, match="nested more than 1024"):
            Serializer().dumps(nested(MAX_DEPTH + 1))
        with pytest.raises(SerializationError, match="nested more than 1024"):
            Serializer().dumps({"a": nested(MAX_DEPTH)})
        if msgpack.version < (1, 2):
            return  # the packer of earlier releases stops at 512
        frames = Serializer().dumps(nested(MAX_DEPTH))
    finally:
        sys.setrecursionlimit(limit)
    assert bytes(frames[0]) == b"\x91" * (MAX_DEPTH - 1) + b"\x90"
    assert nesting(Serializer().loads(frames)) == MAX_DEPTH


def test_raw_ext_types_cannot_be_sent() -> None:
    with pytest.raises(SerializationError, match="ExtType"):
        Serializer().dumps([msgpack.ExtType(EXT_OOB, b"\x00\x00\x00\x00")])


def test_timestamp_extension_roundtrips() -> None:
    stamp = msgpack.Timestamp(1_700_000_000, 5)
    assert roundtrip(Serializer(), {"t": stamp}) == {"t": stamp}


# -- pickled objects are unpickled once the whole body is decoded --------------

UNPICKLED: list[str] = []


def _record(name: str) -> str:
    UNPICKLED.append(name)
    return name


class Recorded:
    """Unpickles to its name, recording that it was unpickled."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return _record, (self.name,)


def pickle_ref(index: int) -> bytes:
    return msgpack.packb(msgpack.ExtType(EXT_PICKLE, struct.pack("!I", index)))


@pytest.fixture
def unpickled() -> list[str]:
    UNPICKLED.clear()
    return UNPICKLED


@pytest.mark.parametrize(
    ("key", "frames"),
    [
        (msgpack.ExtType(EXT_OOB, struct.pack("!I", 0)), [b"k"]),  # a reference to bytes
        (msgpack.ExtType(EXT_OOB, struct.pack("!I", 0)), [b"k" * 64]),  # ... to a view
        (msgpack.ExtType(EXT_PICKLE, struct.pack("!I", 0)), [pickle.dumps("k")]),
        (msgpack.ExtType(EXT_PICKLE, struct.pack("!I", 0)), [pickle.dumps(b"k")]),
        (msgpack.Timestamp(1, 0), []),
    ],
    ids=["oob-bytes", "oob-view", "pickled-str", "pickled-bytes", "timestamp"],
)
def test_extension_values_are_refused_as_map_keys(key: object, frames: list[bytes]) -> None:
    encoded = msgpack.packb({key: 1})
    message = [memoryview(encoded), *map(memoryview, frames)]
    with pytest.raises(RemoteProtocolError, match="not allowed for map key"):
        Serializer(allow_pickle=True).loads(message)


def test_nothing_is_unpickled_from_a_refused_body(unpickled: list[str]) -> None:
    # A pickled object, then a map with an integer key: the body is refused
    # before the pickled object is unpickled.
    encoded = b"\x92" + pickle_ref(0) + msgpack.packb({1: 1})
    frames = [memoryview(encoded), memoryview(pickle.dumps(Recorded("a")))]
    with pytest.raises(RemoteProtocolError, match="int is not allowed for map key"):
        Serializer(allow_pickle=True).loads(frames)
    assert unpickled == []


def test_pickled_objects_are_unpickled_in_body_order(unpickled: list[str]) -> None:
    # [pickled c, {"k": [pickled a], "j": pickled b}, 1, {"k": pickled d, "k": 2}]
    # with the streams of a, b, c, d in frames 1 to 4: unpickled c, a, b; d's
    # map entry is replaced by the later one and d is never unpickled.
    encoded = (
        b"\x94"
        + pickle_ref(2)
        + b"\x82\xa1k\x91"
        + pickle_ref(0)
        + b"\xa1j"
        + pickle_ref(1)
        + b"\x01"
        + b"\x82\xa1k"
        + pickle_ref(3)
        + b"\xa1k\x02"
    )
    streams = [pickle.dumps(Recorded(name)) for name in "abcd"]
    frames = [memoryview(encoded), *map(memoryview, streams)]
    decoded = Serializer(allow_pickle=True).loads(frames)
    assert decoded == ["c", {"k": ["a"], "j": "b"}, 1, {"k": 2}]
    assert unpickled == ["c", "a", "b"]


def test_pickled_object_at_the_deepest_level() -> None:
    encoded = b"\x91" * 1023 + pickle_ref(0)
    value = Serializer(allow_pickle=True).loads([memoryview(encoded), memoryview(pickle.dumps(5))])
    for _ in range(1023):
        assert isinstance(value, list)
        (value,) = value
    assert value == 5


# -- the rules of the specification's section 9.2 at their boundaries ----------


def loads_hex(data: str, *frames: bytes, allow_pickle: bool = False) -> object:
    message = [memoryview(bytes.fromhex(data)), *map(memoryview, frames)]
    return Serializer(allow_pickle=allow_pickle).loads(message)


def ts64(nanoseconds: int, seconds: int, head: str = "d7 ff") -> str:
    """A timestamp 64 (in fixext 8 unless ``head`` says otherwise), in hex."""
    return head + struct.pack("!Q", nanoseconds << 34 | seconds).hex(" ", -8)


def ts96(nanoseconds: int, seconds: int, head: str = "c7 0c ff") -> str:
    """A timestamp 96 (in ext 8 unless ``head`` says otherwise), in hex."""
    return head + struct.pack("!Iq", nanoseconds, seconds).hex(" ", -4)


@pytest.mark.parametrize(
    ("data", "seconds", "nanoseconds"),
    [
        ("d6 ff 00 00 00 01", 1, 0),
        ("d6 ff ff ff ff ff", 2**32 - 1, 0),
        ("c7 04 ff 00 00 00 01", 1, 0),  # ext 8, ext 16 and ext 32 forms
        ("c8 00 04 ff 00 00 00 01", 1, 0),
        ("c9 00 00 00 04 ff 00 00 00 01", 1, 0),
        (ts64(999_999_999, 2**34 - 1), 2**34 - 1, 999_999_999),
        (ts64(0, 1), 1, 0),  # a value timestamp 32 could hold
        (ts64(5, 7, head="c8 00 08 ff"), 7, 5),
        (ts96(999_999_999, -(2**63)), -(2**63), 999_999_999),
        (ts96(0, 2**63 - 1), 2**63 - 1, 0),
        (ts96(0, 1), 1, 0),
        (ts96(5, -7, head="c9 00 00 00 0c ff"), -7, 5),
    ],
)
def test_timestamps_accepted(data: str, seconds: int, nanoseconds: int) -> None:
    assert loads_hex(data) == msgpack.Timestamp(seconds, nanoseconds)


@pytest.mark.parametrize(
    "data",
    [
        *(f"c7 {n:02x} ff" + "00" * n for n in (0, 1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 16)),
        "d4 ff 00",
        "d5 ff 00 00",
        "d8 ff" + "00" * 16,
        ts64(1_000_000_000, 0),
        ts64(2**30 - 1, 0),
        ts96(1_000_000_000, 0),
        ts96(2**32 - 1, 0),
    ],
)
def test_timestamps_rejected(data: str) -> None:
    with pytest.raises(RemoteProtocolError, match="malformed"):
        loads_hex(data)


def test_timestamps_are_sent_in_the_shortest_layout() -> None:
    def sent(stamp: msgpack.Timestamp) -> str:
        return Serializer().dumps(stamp)[0].hex(" ")

    assert sent(msgpack.Timestamp(2**32 - 1, 0)) == "d6 ff ff ff ff ff"
    assert sent(msgpack.Timestamp(2**32, 0)) == "d7 ff 00 00 00 01 00 00 00 00"
    assert sent(msgpack.Timestamp(0, 1)) == "d7 ff 00 00 00 04 00 00 00 00"
    assert sent(msgpack.Timestamp(2**34 - 1, 999_999_999)) == "d7 ff ee 6b 27 ff ff ff ff ff"
    assert sent(msgpack.Timestamp(2**34, 0)) == "c7 0c ff 00 00 00 00 00 00 00 04 00 00 00 00"
    assert sent(msgpack.Timestamp(-1, 0)) == "c7 0c ff 00 00 00 00 ff ff ff ff ff ff ff ff"


@pytest.mark.parametrize("code", [-128, -2, 0, 3, 127])
def test_other_extension_types_rejected(code: int) -> None:
    with pytest.raises(RemoteProtocolError, match=f"unknown msgpack extension type {code}"):
        loads_hex(f"d4 {code & 0xFF:02x} 00", allow_pickle=True)


def depth_body(depth: int, kind: str, inner: str) -> str:
    """A body of ``depth`` arrays or maps (``kind``), nested, around ``inner``."""
    if kind == "array":
        return "91" * depth + inner
    if kind == "map":
        return "81 a1 6b" * depth + inner
    return "91 81 a1 6b" * (depth // 2) + inner  # mixed, depth even


@pytest.mark.parametrize("kind", ["array", "map", "mixed"])
def test_nesting_depth_boundary(kind: str) -> None:
    # The outermost container counts as 1, empty containers count, scalars and
    # extension values do not.
    for accepted, body in [
        (True, depth_body(1024, kind, "01")),
        (True, depth_body(1024, kind, "d6 ff 00 00 00 01")),
        (True, depth_body(1022, kind, "92 90 80")),
        (False, depth_body(1024, kind, "90")),
        (False, depth_body(1024, kind, "80")),
        (False, depth_body(1026, kind, "01")),
    ]:
        if accepted:
            loads_hex(body)
        else:
            with pytest.raises(RemoteProtocolError, match="StackError"):
                loads_hex(body)


def test_nesting_depth_is_per_path() -> None:
    deep = "91" * 1022 + "90"  # depth 1023
    loads_hex("92" + deep + deep)  # two of them in an array: depth 1024
    with pytest.raises(RemoteProtocolError, match="StackError"):
        loads_hex("92 01 91" + deep)  # depth 1025 in the last element


def test_nesting_depth_of_a_reference_at_the_deepest_level() -> None:
    decoded = loads_hex("91" * 1024 + "d6 01 00 00 00 00", b"data")
    for _ in range(1024):
        assert isinstance(decoded, list)
        (decoded,) = decoded
    assert bytes(decoded) == b"data"  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ("82 a1 6b 01 c4 01 6b 02", {"k": 1, b"k": 2}),  # str and bin: two keys
        ("82 c4 01 6b 01 a1 6b 02", {b"k": 1, "k": 2}),
        ("82 a1 6b 01 d9 01 6b 02", {"k": 2}),  # fixstr and str 8: equal keys
        ("82 c4 01 6b 01 c5 00 01 6b 02", {b"k": 2}),  # bin 8 and bin 16: equal keys
        ("82 a2 c3 a9 01 a3 65 cc 81 02", {"\u00e9": 1, "e\u0301": 2}),  # no normalization
    ],
)
def test_map_key_equality(data: str, expected: dict[object, object]) -> None:
    decoded = loads_hex(data)
    assert decoded == expected
    assert list(decoded) == list(expected)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("data", "accepted"),
    [
        ("a4 f4 8f bf bf", True),  # U+10FFFF
        ("a2 c0 80", False),  # overlong NUL
        ("a3 ed a0 80", False),  # encoded surrogate U+D800
        ("a4 f4 90 80 80", False),  # above U+10FFFF
    ],
)
def test_utf8_validity(data: str, accepted: bool) -> None:
    if accepted:
        assert loads_hex(data) == "\U0010ffff"
    else:
        with pytest.raises(RemoteProtocolError, match="UnicodeDecodeError"):
            loads_hex(data)


@pytest.mark.parametrize(
    ("data", "accepted"),
    [
        ("d6 01 00 00 00 01", True),
        ("c7 04 01 00 00 00 01", True),
        ("c8 00 04 01 00 00 00 01", True),
        ("c9 00 00 00 04 01 00 00 00 01", True),
        ("d4 01 01", False),
        ("d5 01 00 01", False),
        ("d7 01 00 00 00 00 00 00 00 01", False),
        ("d8 01" + "00" * 15 + "01", False),
        ("c7 00 01", False),
        ("c7 03 01 00 00 01", False),
        ("c7 05 01 00 00 00 01 00", False),
        ("c8 00 08 01 00 00 00 01 00 00 00 00", False),
    ],
)
def test_out_of_band_reference_forms(data: str, accepted: bool) -> None:
    if accepted:
        assert bytes(loads_hex(data, b"zero", b"one")) == b"one"  # type: ignore[call-overload]
    else:
        with pytest.raises(RemoteProtocolError, match="malformed out-of-band reference"):
            loads_hex(data, b"zero", b"one")


@pytest.mark.parametrize(
    ("data", "accepted"),
    [
        ("d6 02 00 00 00 01", True),
        ("d7 02 00 00 00 01 00 00 00 00", True),  # a buffer too (frame 1 again)
        ("d8 02 00 00 00 01" + "00 00 00 00" * 3, True),
        ("c7 04 02 00 00 00 01", True),
        ("c8 00 04 02 00 00 00 01", True),
        ("c9 00 00 00 04 02 00 00 00 01", True),
        ("c7 0c 02 00 00 00 01" + "00 00 00 00" * 2, True),
        ("d4 02 01", False),
        ("d5 02 00 01", False),
        ("c7 00 02", False),
        ("c7 06 02 00 00 00 01 00 00", False),
    ],
)
def test_pickle_reference_forms(data: str, accepted: bool) -> None:
    frames = (pickle.dumps("zero"), pickle.dumps("one"))
    if accepted:
        assert loads_hex(data, *frames, allow_pickle=True) == "one"
    else:
        with pytest.raises(RemoteProtocolError, match="malformed pickle reference"):
            loads_hex(data, *frames, allow_pickle=True)
