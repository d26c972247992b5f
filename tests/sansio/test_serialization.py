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
        frames = Serializer().dumps(nested(MAX_DEPTH))
        with pytest.raises(SerializationError, match="nested more than 1024"):
            Serializer().dumps(nested(MAX_DEPTH + 1))
        with pytest.raises(SerializationError, match="nested more than 1024"):
            Serializer().dumps({"a": nested(MAX_DEPTH)})
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
        (msgpack.ExtType(EXT_PICKLE, struct.pack("!I", 0)), [pickle.dumps("k")]),
        (msgpack.ExtType(EXT_PICKLE, struct.pack("!I", 0)), [pickle.dumps(b"k")]),
        (msgpack.Timestamp(1, 0), []),
    ],
    ids=["oob-bytes", "pickled-str", "pickled-bytes", "timestamp"],
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
