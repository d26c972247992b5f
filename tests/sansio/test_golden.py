"""The golden vectors and constants of ``docs/wire-format.md`` match the code.

Every ```` ```hex golden:NAME ```` block of the specification is checked in
both directions: the encoders produce exactly those bytes, and the decoder
parses them back into what the specification says they contain. Every
```` ```hex reject:NAME ```` block is fed to the decoder, or decoded as a
message, with the receiver the text after it describes, and must fail where
and how that text says.
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from anyio_comm import RemoteProtocolError
from anyio_comm._build import compiled_modules
from anyio_comm._sansio.close import (
    CLOSE_MARKER,
    MAX_CLOSE_TEXT,
    CloseCode,
    CloseReason,
    encode_close_record,
)
from anyio_comm._sansio.compression import CODEC_SHIFT, CODECS
from anyio_comm._sansio.connection import Connection
from anyio_comm._sansio.decoder import EndOfData, FrameDecoder
from anyio_comm._sansio.serialization import (
    DEFAULT_OOB_THRESHOLD,
    EXT_OOB,
    EXT_PICKLE,
    Serializer,
)
from anyio_comm._sansio.wire import (
    MAGIC,
    MAX_PREAMBLE_BODY,
    PREAMBLE_BODY_V1_SIZE,
    PREAMBLE_FIXED_SIZE,
    PROTOCOL_VERSION,
    Capability,
    Handshake,
    Limits,
    encode_header,
    encode_preamble,
)

DOC = Path(__file__).parents[2] / "docs" / "wire-format.md"

EXPECTED_VECTORS = {
    "preamble-default",
    "preamble-custom-limits",
    "preamble-v1-default",
    "preamble-compression",
    "frames-lz4",
    "preamble-v3-forward-compat",
    "close-going-away",
    "close-handler-error",
    "frames-hello-empty",
    "frames-zero",
    "message-small-map",
    "message-types",
    "message-oob",
    "message-two-oob",
    "message-timestamps",
    "message-form-str",
    "message-form-bin",
    "message-form-array",
    "message-form-map",
    "message-form-uint",
    "message-form-int",
    "message-form-float32",
    "message-form-oob",
    "message-form-pickle",
}

EXPECTED_REJECTS = {
    "preamble-magic-lf",
    "preamble-version-0",
    "preamble-body-length-19",
    "preamble-body-length-1025",
    "preamble-truncated",
    "frames-count-over-max",
    "frames-frame-over-max",
    "frames-message-over-max",
    "frames-message-size-overflow",
    "frames-truncated-header",
    "frames-truncated-frames",
    "preamble-capability-cut",
    "preamble-capability-past-end",
    "preamble-capability-twice",
    "close-text-too-long",
    "close-name-not-utf8",
    "close-truncated",
    "compressed-codec-unlisted",
    "compressed-length-not-below",
    "compressed-length-one",
    "compressed-bad-data",
    "message-zero-frames",
    "message-empty-body",
    "message-truncated-body",
    "message-trailing-bytes",
    "message-type-c1",
    "message-str-not-utf8",
    "message-key-int",
    "message-key-oob",
    "message-key-pickle",
    "message-key-timestamp",
    "message-depth-1025",
    "message-ext-type-3",
    "message-ext-type-minus-2",
    "message-timestamp-length",
    "message-timestamp64-nanoseconds",
    "message-timestamp96-nanoseconds",
    "message-oob-fixext8",
    "message-oob-index",
    "message-pickle-disabled",
    "message-pickle-empty",
    "message-pickle-length",
    "message-pickle-index",
    "message-pickle-stream",
}
#: why the reference implementation rejects each message-layer vector
REJECT_ERRORS = {
    "message-zero-frames": "no body frame",
    "message-empty-body": "malformed message body",
    "message-truncated-body": "malformed message body",
    "message-trailing-bytes": "malformed message body: 1 byte after its value",
    "message-type-c1": "malformed message body",
    "message-str-not-utf8": "malformed message body: UnicodeDecodeError",
    "message-key-int": "int is not allowed for map key",
    "message-key-oob": "memoryview is not allowed for map key",
    "message-key-pickle": "_Pickled is not allowed for map key",
    "message-key-timestamp": "Timestamp is not allowed for map key",
    "message-depth-1025": "malformed message body: StackError",
    "message-ext-type-3": "unknown msgpack extension type 3$",
    "message-ext-type-minus-2": "unknown msgpack extension type -2$",
    "message-timestamp-length": "malformed message body: ValueError",
    "message-timestamp64-nanoseconds": "nanoseconds must be",
    "message-timestamp96-nanoseconds": "nanoseconds must be",
    "message-oob-fixext8": "malformed out-of-band reference",
    "message-oob-index": "out-of-band reference 1 but the message has 1 out-of-band frames",
    "message-pickle-disabled": "pickle is not enabled",
    "message-pickle-empty": "malformed pickle reference",
    "message-pickle-length": "malformed pickle reference",
    "message-pickle-index": "out-of-band reference 1 but the message has 1 out-of-band frames",
    "message-pickle-stream": "cannot unpickle: EOFError",
}

_GOLDEN_BLOCK = re.compile(
    r"^```hex golden:(?P<name>[A-Za-z0-9._-]+)[ \t]*\n(?P<body>.*?)^```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
_REJECT_BLOCK = re.compile(
    r"^```hex reject:(?P<name>[A-Za-z0-9._-]+)[ \t]*\n(?P<body>.*?)^```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
_HEX_BYTE = re.compile(r"[0-9A-Fa-f]{2}")
#: a token of a reject vector: a byte, or ``XX*N`` for N bytes XX
_REJECT_TOKEN = re.compile(r"(?P<byte>[0-9A-Fa-f]{2})(?:\*(?P<count>[1-9][0-9]*))?")
#: the paragraph after a reject vector
_REJECT_NOTE = re.compile(
    r"Receiver: (?P<receiver>.+?)\. Violates section (?P<section>[0-9]+(?:\.[0-9]+)?): "
    r"(?P<rule>.+?)\. Detected (?P<when>at byte (?P<byte>[0-9]+), the last of the vector"
    r"|at the end of the stream, which follows the vector|when the message is decoded)[.,( ]"
)
_LIMIT_VALUE = re.compile(
    r"`(?P<name>max_frames|max_frame_size|max_message_size)` "
    r"(?:2\^(?P<power>[0-9]+)(?P<less> - 1)?|(?P<number>[0-9]+))"
)

CUSTOM_LIMITS = Limits(max_frames=8, max_frame_size=65536, max_message_size=1_000_000)
CLOSE = frozenset({Capability.CLOSE_REASONS})
TYPES_MESSAGE = {"op": "put", "key": b"k1", "args": [1, -1, 300, 1.5, None, True, "é"]}
OOB_DATA = bytes(5000)
TWO_OOB_1 = b"\x01" * 4096
TWO_OOB_2 = b"\xff" * 5000
TIMESTAMPS = [
    msgpack.Timestamp(1, 0),
    msgpack.Timestamp(2**32, 999_999_999),
    msgpack.Timestamp(-1, 500_000_000),
]
#: the out-of-band frames of the message-form-* vectors that have some
FORM_FRAMES = {
    "message-form-oob": [b"a", b"b", b"c"],
    "message-form-pickle": [bytes.fromhex(f"80 05 4b 0{i} 2e") for i in (1, 2, 3)],
}
#: what the message-form-* vectors decode to
FORM_VALUES: dict[str, object] = {
    "message-form-str": ["a", "a", "a"],
    "message-form-bin": [b"\x01", b"\x01"],
    "message-form-array": [[1], []],
    "message-form-map": {"a": {"b": 1}},
    "message-form-uint": [1, 1, 1, 1],
    "message-form-int": [-1, -1, -1, -1, 1],
    "message-form-float32": 1.5,
    "message-form-oob": [b"a", b"b", b"c"],
    "message-form-pickle": [1, 2, 3],
}


# -- parsing the document ---------------------------------------------------


def parse_golden(text: str) -> dict[str, bytes]:
    """Return every ``hex golden:NAME`` block of ``text`` as ``{NAME: bytes}``."""
    vectors: dict[str, bytes] = {}
    for match in _GOLDEN_BLOCK.finditer(text):
        name = match["name"]
        assert name not in vectors, f"golden vector {name!r} appears twice"
        tokens = match["body"].split()
        bad = [token for token in tokens if not _HEX_BYTE.fullmatch(token)]
        assert not bad, f"golden vector {name!r}: not hex byte pairs: {bad}"
        assert tokens, f"golden vector {name!r} is empty"
        vectors[name] = bytes.fromhex("".join(tokens))
    return vectors


def parse_reject(text: str) -> dict[str, bytes]:
    """Return every ``hex reject:NAME`` block of ``text`` as ``{NAME: bytes}``."""
    vectors: dict[str, bytes] = {}
    for match in _REJECT_BLOCK.finditer(text):
        name = match["name"]
        assert name not in vectors, f"reject vector {name!r} appears twice"
        tokens = match["body"].split()
        assert tokens, f"reject vector {name!r} is empty"
        data = bytearray()
        for token in tokens:
            parsed = _REJECT_TOKEN.fullmatch(token)
            assert parsed, f"reject vector {name!r}: not a byte or XX*N: {token!r}"
            data += bytes.fromhex(parsed["byte"]) * int(parsed["count"] or 1)
        vectors[name] = bytes(data)
    return vectors


def reject_notes(text: str) -> dict[str, re.Match[str]]:
    """The paragraph after each reject vector, parsed."""
    notes = {}
    for match in _REJECT_BLOCK.finditer(text):
        paragraph = text[match.end() :].lstrip("\n").split("\n\n", 1)[0]
        note = _REJECT_NOTE.match(" ".join(paragraph.split()))
        assert note, f"reject vector {match['name']!r}: no Receiver/Violates/Detected note"
        notes[match["name"]] = note
    return notes


def receiver_of(note: re.Match[str]) -> tuple[Limits, bool]:
    """The limits and pickle setting a reject vector's note gives its receiver."""
    receiver = note["receiver"]
    values = {}
    for value in _LIMIT_VALUE.finditer(receiver):
        if value["number"] is not None:
            values[value["name"]] = int(value["number"])
        else:
            values[value["name"]] = 2 ** int(value["power"]) - (1 if value["less"] else 0)
    if not values:
        assert receiver.split(",")[0] in {"any limits", "the default limits"}, receiver
    allow_pickle = receiver.endswith(", pickle enabled")
    return Limits(**values), allow_pickle


def parse_table(text: str, anchor: str) -> list[list[str]]:
    """Return the body rows of the Markdown table following ``<!-- anchor -->``."""
    lines = text.split(f"<!-- {anchor} -->\n", 1)[1].splitlines()
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    _header, separator, *body = rows
    assert set(separator) <= {"---"}, f"table {anchor!r} is malformed"
    assert body, f"table {anchor!r} has no rows"
    return body


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def vectors(doc: str) -> dict[str, bytes]:
    return parse_golden(doc)


@pytest.fixture(scope="module")
def rejects(doc: str) -> dict[str, bytes]:
    return parse_reject(doc)


@pytest.fixture(scope="module")
def notes(doc: str) -> dict[str, re.Match[str]]:
    return reject_notes(doc)


def test_golden_block_pattern_is_strict():
    text = "intro\n```hex golden:x\n01 ab\nCD\n```\n\n```hex golden:y\n0g\n```\n"
    with pytest.raises(AssertionError, match="not hex byte pairs"):
        parse_golden(text)
    assert parse_golden(text.split("\n\n")[0] + "\n") == {"x": b"\x01\xab\xcd"}


def test_reject_block_pattern_is_strict():
    text = "```hex reject:x\n01 ab*2\n90*3 CD\n```\n\n```hex reject:y\n91**2\n```\n"
    with pytest.raises(AssertionError, match="not a byte or XX"):
        parse_reject(text)
    assert parse_reject(text.split("\n\n")[0] + "\n") == {"x": bytes.fromhex("01abab909090cd")}
    for token in ("91*0", "91*", "9*2", "91*-1", "911"):
        with pytest.raises(AssertionError, match="not a byte or XX"):
            parse_reject(f"```hex reject:z\n{token}\n```\n")


def test_every_hex_block_is_a_golden_or_reject_vector(doc: str):
    blocks = [line for line in doc.splitlines() if line.startswith("```hex")]
    pattern = re.compile(r"```hex (golden|reject):[A-Za-z0-9._-]+")
    assert [line for line in blocks if not pattern.fullmatch(line)] == []
    assert len(blocks) == len(EXPECTED_VECTORS) + len(EXPECTED_REJECTS)


def test_all_vectors_present(vectors: dict[str, bytes], rejects: dict[str, bytes]):
    assert set(vectors) == EXPECTED_VECTORS
    assert set(rejects) == EXPECTED_REJECTS
    assert set(REJECT_ERRORS) == {name for name in EXPECTED_REJECTS if name.startswith("message-")}


def test_every_vector_has_a_description(doc: str):
    lines = doc.splitlines()
    for index, line in enumerate(lines):
        if line.startswith(("```hex golden:", "```hex reject:")):
            previous = [text for text in lines[:index] if text.strip()][-1]
            assert not previous.startswith(("```", "#", "|")), line
            assert previous.rstrip().endswith(":"), line


def test_every_reject_vector_has_a_description(
    doc: str, rejects: dict[str, bytes], notes: dict[str, re.Match[str]]
):
    # All in section 11.4, the last subsection of section 11.
    section = doc.split("\n### 11.4 Rejected inputs\n", 1)[1]
    assert "\n## " not in section and "\n### " not in section
    assert set(parse_reject(section)) == EXPECTED_REJECTS
    headings = {
        heading.split(" ")[1].rstrip(".")
        for heading in doc.splitlines()
        if heading.startswith(("## ", "### "))
    }
    assert set(notes) == EXPECTED_REJECTS
    for name, note in notes.items():
        assert note["section"] in headings, f"{name}: no section {note['section']}"
        receiver_of(note)
        if name.startswith("message-"):
            assert note["when"] == "when the message is decoded", name
        elif "truncated" in name:
            assert note["when"].startswith("at the end of the stream"), name
        else:
            assert int(note["byte"]) == len(rejects[name]), name


# -- decoding helpers -------------------------------------------------------


def decode_handshake(data: bytes, *, version: int = 2) -> tuple[FrameDecoder, Handshake]:
    """Decode a preamble that must be exactly ``data``, fed one byte at a time, by a
    side that speaks up to ``version``."""
    decoder = FrameDecoder(version=version)
    for i in range(len(data) - 1):
        decoder.feed(data[i : i + 1])
        assert decoder.next_handshake() is None, f"preamble complete after {i + 1} bytes"
    decoder.feed(data[-1:])
    handshake = decoder.next_handshake()
    assert handshake is not None
    # Nothing of the preamble is left over: a zero-frame message decodes next.
    decoder.feed(b"\x00\x00\x00\x00")
    assert decoder.next_message() == []
    assert decoder.at_message_boundary
    return decoder, handshake


def decode_frames(data: bytes) -> list[bytes]:
    """Decode one message that must be exactly ``data``."""
    decoder = FrameDecoder()
    decoder.feed(encode_preamble(Limits()))
    assert decoder.next_handshake() is not None
    if data[:-1]:
        decoder.feed(data[:-1])
        assert decoder.next_message() is None, "message complete before its last byte"
    decoder.feed(data[-1:])
    frames = decoder.next_message()
    assert frames is not None
    assert decoder.at_message_boundary, "bytes left over after the message"
    decoder.receive_eof()
    with pytest.raises(EndOfData) as exc_info:
        decoder.next_message()
    assert not exc_info.value.truncated
    return [bytes(frame) for frame in frames]


#: the out-of-band threshold the spec's vectors were encoded with (section 9.5)
VECTORS_OOB_THRESHOLD = 4096


def encode_message(message: object) -> tuple[bytes, list[bytes]]:
    """Return the header + body of ``message`` and its out-of-band frames, as a
    sender with the vectors' threshold encodes them."""
    frames = Serializer(oob_threshold=VECTORS_OOB_THRESHOLD).dumps(message)
    header = encode_header([frame.nbytes for frame in frames])
    return header + bytes(frames[0]), [bytes(frame) for frame in frames[1:]]


def decode_message(data: bytes, *, allow_pickle: bool = False) -> object:
    frames = decode_frames(data)
    return Serializer(allow_pickle=allow_pickle).loads([memoryview(frame) for frame in frames])


# -- preambles ---------------------------------------------------------------


def test_preamble_default(vectors: dict[str, bytes]):
    vector = vectors["preamble-default"]
    assert Connection().preamble() == vector  # what a default connection sends
    assert encode_preamble(Limits(), CLOSE) == vector
    _, handshake = decode_handshake(vector)
    assert handshake == Handshake(2, Limits(), CLOSE)
    assert handshake.limits == Limits(16_384, 2**30, 2**31)
    # a version-1 side reads the limits and ignores the capability entry
    _, handshake = decode_handshake(vector, version=1)
    assert handshake == Handshake(1, Limits())


def test_preamble_custom_limits(vectors: dict[str, bytes]):
    vector = vectors["preamble-custom-limits"]
    both = {Capability.CLOSE_REASONS, Capability.PICKLE}
    assert encode_preamble(CUSTOM_LIMITS, both) == vector
    assert encode_preamble(CUSTOM_LIMITS, [Capability.PICKLE, Capability.CLOSE_REASONS]) == vector
    assert Connection(CUSTOM_LIMITS, capabilities=both).preamble() == vector
    _, handshake = decode_handshake(vector)
    assert handshake == Handshake(2, CUSTOM_LIMITS, frozenset(both))


def test_preamble_compression(vectors: dict[str, bytes]):
    vector = vectors["preamble-compression"]
    assert encode_preamble(Limits(), CLOSE, compression=("zstd", "lz4")) == vector
    _, handshake = decode_handshake(vector)
    assert handshake == Handshake(
        2, Limits(), frozenset({Capability.CLOSE_REASONS, Capability.COMPRESSION}), ("zstd", "lz4")
    )


def test_frames_lz4(vectors: dict[str, bytes]):
    pytest.importorskip("cramjam")
    vector = vectors["frames-lz4"]
    decoder = FrameDecoder(compression=("lz4",))
    decoder.feed(encode_preamble(Limits()))
    assert decoder.next_handshake() is not None
    for i in range(len(vector) - 1):
        decoder.feed(vector[i : i + 1])
        assert decoder.next_message() is None
    decoder.feed(vector[-1:])
    assert [bytes(frame) for frame in decoder.next_message() or []] == [b"a" * 64]
    # The reference sender's header for it (it compresses only frames of 64 KiB and
    # more, and its LZ4 library may pick other bytes for the block).
    conn = Connection(compression=("lz4",))
    conn.receive_data(encode_preamble(Limits(), compression=("lz4",)))
    assert conn.next_handshake() is not None
    frame = memoryview(b"a" * 65536)
    header = bytes(conn.send_message([frame])[0])[:12]
    assert header == bytes.fromhex("00000001 0100000000010000")


def test_preamble_v1_default(vectors: dict[str, bytes]):
    vector = vectors["preamble-v1-default"]
    assert encode_preamble(Limits(), version=1) == vector
    assert Connection(version=1).preamble() == vector
    for version in (1, 2):
        _, handshake = decode_handshake(vector, version=version)
        assert handshake == Handshake(1, Limits())
    # On the version-1 connection FF FF FF FF is a frame count, over the limits,
    # even for a side that accepts close records.
    decoder = FrameDecoder(capabilities=CLOSE)
    decoder.feed(vector + encode_close_record(CloseReason(CloseCode.NORMAL)))
    assert decoder.next_handshake() == Handshake(1, Limits())
    with pytest.raises(RemoteProtocolError, match="frames") as info:
        decoder.next_message()
    assert info.value.rule == "max_frames"


def test_preamble_v3_forward_compat(vectors: dict[str, bytes]):
    vector = vectors["preamble-v3-forward-compat"]
    entries = bytes.fromhex("0001 0002 aabb 0100 0003 010203 8001 0000")
    body = encode_preamble(Limits(), version=1)[PREAMBLE_FIXED_SIZE:] + entries
    assert vector == MAGIC + struct.pack("!HH", 3, len(body)) + body
    _, handshake = decode_handshake(vector)
    assert handshake == Handshake(2, Limits(), CLOSE)
    _, handshake = decode_handshake(vector, version=1)
    assert handshake == Handshake(1, Limits())


# -- frames layer ------------------------------------------------------------


def test_frames_hello_empty(vectors: dict[str, bytes]):
    vector = vectors["frames-hello-empty"]
    frames = [b"hello", b""]
    assert encode_header([len(frame) for frame in frames]) + b"".join(frames) == vector
    assert decode_frames(vector) == frames


def test_frames_zero(vectors: dict[str, bytes]):
    vector = vectors["frames-zero"]
    assert encode_header([]) == vector
    assert decode_frames(vector) == []


def decode_close_record(data: bytes) -> EndOfData:
    """Feed ``data`` byte by byte after a message, to a side that accepts close
    records on a version-2 connection; return the end it reports."""
    decoder = FrameDecoder(capabilities=CLOSE)
    decoder.feed(encode_preamble(Limits()) + bytes.fromhex("00000001 0000000000000001 2a"))
    assert decoder.next_handshake() is not None
    assert decoder.next_message() == [b"*"]  # the message before it is delivered
    for i in range(len(data) - 1):
        decoder.feed(data[i : i + 1])
        assert decoder.next_message() is None, f"record complete after {i + 1} bytes"
    decoder.feed(data[-1:] + b"ignored: nothing after a close record is parsed")
    with pytest.raises(EndOfData) as info:
        decoder.next_message()
    end = info.value
    assert not end.truncated and end.reason is not None
    with pytest.raises(EndOfData) as again:  # final
        decoder.next_message()
    assert again.value.reason == end.reason
    return end


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("close-going-away", CloseReason(CloseCode.GOING_AWAY)),
        (
            "close-handler-error",
            CloseReason(CloseCode.HANDLER_ERROR, "RuntimeError", "bug in the handler"),
        ),
    ],
)
def test_close_records(vectors: dict[str, bytes], name: str, reason: CloseReason):
    vector = vectors[name]
    assert encode_close_record(reason) == vector
    # what a connection sends once the peer accepts close records
    conn = Connection()
    conn.receive_data(encode_preamble(Limits(), CLOSE))
    assert conn.next_handshake() is not None
    assert conn.close_record(reason) == vector
    end = decode_close_record(vector)
    assert end.reason == reason
    assert end.reason.clean is (name == "close-going-away")
    assert type(end.reason.code) is CloseCode


# -- message layer -----------------------------------------------------------


def test_message_small_map(vectors: dict[str, bytes]):
    vector = vectors["message-small-map"]
    assert encode_message({"a": 1}) == (vector, [])
    assert decode_message(vector) == {"a": 1}


def test_message_types(vectors: dict[str, bytes]):
    vector = vectors["message-types"]
    assert encode_message(TYPES_MESSAGE) == (vector, [])
    decoded = decode_message(vector)
    assert decoded == TYPES_MESSAGE
    assert type(decoded["key"]) is bytes


def test_message_oob(vectors: dict[str, bytes]):
    vector = vectors["message-oob"]
    assert encode_message({"data": OOB_DATA}) == (vector, [OOB_DATA])
    assert decode_frames(vector + OOB_DATA) == [vector[20:], OOB_DATA]
    decoded = decode_message(vector + OOB_DATA)
    assert isinstance(decoded, dict)
    assert list(decoded) == ["data"]
    assert isinstance(decoded["data"], memoryview)
    assert bytes(decoded["data"]) == OOB_DATA


def test_message_two_oob(vectors: dict[str, bytes]):
    vector = vectors["message-two-oob"]
    message = ["x", TWO_OOB_1, {"b": TWO_OOB_2}]
    assert len(TWO_OOB_1) == VECTORS_OOB_THRESHOLD
    assert encode_message(message) == (vector, [TWO_OOB_1, TWO_OOB_2])
    decoded = decode_message(vector + TWO_OOB_1 + TWO_OOB_2)
    assert isinstance(decoded, list)
    assert len(decoded) == 3
    assert decoded[0] == "x"
    assert bytes(decoded[1]) == TWO_OOB_1
    assert list(decoded[2]) == ["b"]
    assert bytes(decoded[2]["b"]) == TWO_OOB_2


def test_message_timestamps(vectors: dict[str, bytes]):
    vector = vectors["message-timestamps"]
    assert encode_message(TIMESTAMPS) == (vector, [])
    assert decode_message(vector) == TIMESTAMPS


@pytest.mark.parametrize("name", sorted(FORM_VALUES))
def test_message_forms_are_accepted(vectors: dict[str, bytes], name: str):
    vector = vectors[name]
    frames = FORM_FRAMES.get(name, [])
    decoded = decode_message(vector + b"".join(frames), allow_pickle=name.endswith("pickle"))
    expected = FORM_VALUES[name]
    if name == "message-form-oob":
        assert isinstance(decoded, list)
        assert all(isinstance(item, memoryview) for item in decoded)
        decoded = [bytes(item) for item in decoded]
    assert decoded == expected
    assert type(decoded) is type(expected)
    # Not what the reference implementation sends for the same value.
    assert encode_message(expected)[0] != vector


# -- constants and layout tables ---------------------------------------------


def test_constants_table(doc: str):
    table = {row[0].strip("`"): row[1].strip("`") for row in parse_table(doc, "constants")}
    defaults = Limits()
    expected = {
        "MAGIC": MAGIC.hex(" ").upper(),
        "PROTOCOL_VERSION": str(PROTOCOL_VERSION),
        "PREAMBLE_FIXED_SIZE": str(PREAMBLE_FIXED_SIZE),
        "PREAMBLE_BODY_MIN": str(PREAMBLE_BODY_V1_SIZE),
        "PREAMBLE_BODY_MAX": str(MAX_PREAMBLE_BODY),
        "EXT_OOB": str(EXT_OOB),
        "EXT_PICKLE": str(EXT_PICKLE),
        "CAP_CLOSE_REASONS": str(int(Capability.CLOSE_REASONS)),
        "CAP_PICKLE": str(int(Capability.PICKLE)),
        "CAP_COMPRESSION": str(int(Capability.COMPRESSION)),
        "CLOSE_MARKER": CLOSE_MARKER.to_bytes(4, "big").hex(" ").upper(),
        "CLOSE_TEXT_MAX": str(MAX_CLOSE_TEXT),
        "OOB_THRESHOLD": str(DEFAULT_OOB_THRESHOLD),
        "DEFAULT_MAX_FRAMES": str(defaults.max_frames),
        "DEFAULT_MAX_FRAME_SIZE": str(defaults.max_frame_size),
        "DEFAULT_MAX_MESSAGE_SIZE": str(defaults.max_message_size),
    }
    assert table == expected


def test_constants_in_prose(doc: str):
    magic = MAGIC.hex(" ").upper()
    assert magic == "89 41 43 4F 4D 4D 0D 0A"
    assert f"`magic` | `{magic}`." in doc
    assert f"The magic is the 8 bytes `{magic}`" in doc
    assert f"this document specifies versions 1 and {PROTOCOL_VERSION}." in doc
    assert (
        f"`body_length` between {PREAMBLE_BODY_V1_SIZE} and {MAX_PREAMBLE_BODY} inclusive" in doc
    )
    assert f"`EXT_OOB` = {EXT_OOB}" in doc
    assert f"`EXT_PICKLE` = {EXT_PICKLE}" in doc
    assert f"of at least {DEFAULT_OOB_THRESHOLD} bytes" in doc
    assert f"encoded with a\nthreshold of {VECTORS_OOB_THRESHOLD} bytes" in doc


_TYPE_SIZES = {"u16": 2, "u32": 4, "u64": 8}


def check_layout(rows: list[list[str]]) -> list[tuple[int, int, str, str]]:
    """Check a fixed-size layout table is contiguous; return (offset, size, type, field)."""
    fields = []
    offset = 0
    for row in rows:
        row_offset, size, type_, field = int(row[0]), int(row[1]), row[2], row[3].strip("`")
        assert row_offset == offset, f"{field} at offset {row_offset}, expected {offset}"
        if type_ in _TYPE_SIZES:
            assert size == _TYPE_SIZES[type_], f"{field}: {type_} is not {size} bytes"
        fields.append((row_offset, size, type_, field))
        offset += size
    return fields


def test_preamble_layout_table(doc: str):
    *fixed, body = parse_table(doc, "layout:preamble")
    fields = check_layout(fixed)
    assert [field[3] for field in fields] == ["magic", "version", "body_length"]
    assert int(body[0]) == PREAMBLE_FIXED_SIZE
    assert body[3] == "`body`"
    preamble = encode_preamble(CUSTOM_LIMITS, version=7)
    assert preamble[: fields[0][1]] == MAGIC
    assert int.from_bytes(preamble[8:10], "big") == 7
    assert int.from_bytes(preamble[10:12], "big") == PREAMBLE_BODY_V1_SIZE


def test_capability_entry_layout_table(doc: str):
    *fixed, value = parse_table(doc, "layout:capability-entry")
    assert [field[3] for field in check_layout(fixed)] == ["id", "length"]
    assert value[:4] == ["4", "V", "bytes", "`value`"]
    entries = encode_preamble(Limits(), CLOSE)[PREAMBLE_FIXED_SIZE + PREAMBLE_BODY_V1_SIZE :]
    assert entries == struct.pack("!HH", Capability.CLOSE_REASONS, 0)


def test_compressed_frame_layout_table(doc: str):
    fields = check_layout(parse_table(doc, "layout:compressed-frame")[:1])
    assert [field[3] for field in fields] == ["compressed_length"]
    rows = parse_table(doc, "layout:length-entry")
    assert [row[:2] for row in rows] == [["63 to 56", "`codec`"], ["55 to 0", "`length`"]]
    assert CODEC_SHIFT == 56
    section = doc.split("### 6.1 Compressed frames (version 2)\n", 1)[1].split("\n## ", 1)[0]
    codecs = {
        line.split("|")[2].strip().strip("`"): int(line.split("|")[1])
        for line in section.splitlines()
        if line.startswith("| ")
        and line.split("|")[1].strip().isdigit()
        and line.split("|")[2].strip().startswith("`")
    }
    assert codecs == CODECS


def test_capability_table(doc: str):
    section = doc.split("### 4.10 Capabilities (version 2)\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| ") and line.split("|")[2].strip().startswith("`CAP_")
    ]
    assert {int(row[0]): row[1].strip("`") for row in rows} == {
        int(capability): f"CAP_{capability.name}" for capability in Capability
    }


def test_close_record_layout_table(doc: str):
    rows = parse_table(doc, "layout:close-record")
    assert [row[3].strip("`") for row in rows] == [
        "marker",
        "code",
        "name_length",
        "name",
        "text_length",
        "text",
    ]
    record = encode_close_record(CloseReason(0x1234, "ab", "xyz"))
    assert record == bytes.fromhex("ffffffff 1234 02 6162 0003 78797a")
    longest = encode_close_record(CloseReason(0xFFFF, "n" * 255, "t" * MAX_CLOSE_TEXT))
    assert len(longest) == 1288
    assert "A close record is 9 to 1288 bytes long." in doc
    assert len(encode_close_record(CloseReason(0))) == 9


def test_close_code_table(doc: str):
    section = doc.split("### 7.2 Close records (version 2)\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        [cell.strip().strip("`") for cell in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| `0x")
    ]
    assert {int(row[0], 16): (row[1], row[2]) for row in rows} == {
        int(code): (code.name, "yes" if CloseReason(code).clean else "no") for code in CloseCode
    }


def test_preamble_body_layout_table(doc: str):
    fields = check_layout(parse_table(doc, "layout:preamble-body-v1"))
    names = [field[3] for field in fields]
    assert names == [field.name for field in dataclasses.fields(Limits)]
    assert sum(field[1] for field in fields) == PREAMBLE_BODY_V1_SIZE
    limits = Limits(max_frames=0x01020304, max_frame_size=2**40 + 5, max_message_size=2**63 + 9)
    body = encode_preamble(limits)[PREAMBLE_FIXED_SIZE:]
    for offset, size, _, name in fields:
        assert int.from_bytes(body[offset : offset + size], "big") == getattr(limits, name)


def test_message_layout_table(doc: str):
    rows = parse_table(doc, "layout:message")
    assert [row[:4] for row in rows] == [
        ["0", "4", "u32", "`count`"],
        ["4", "8 x N", "u64[N]", "`lengths`"],
        ["4 + 8N", "sum of lengths", "bytes", "`frames`"],
    ]
    lengths = [3, 0, 2**40]
    header = encode_header(lengths)
    assert len(header) == 4 + 8 * len(lengths)
    assert struct.unpack("!I3Q", header) == (3, *lengths)


# -- statements of the specification -----------------------------------------


@pytest.mark.parametrize("position", range(len(MAGIC)))
def test_bad_magic_fails_on_first_wrong_byte(vectors: dict[str, bytes], position: int):
    data = bytearray(vectors["preamble-default"][: position + 1])
    data[position] ^= 0x80
    decoder = FrameDecoder()
    decoder.feed(data)
    with pytest.raises(RemoteProtocolError, match="bad magic"):
        decoder.next_handshake()


@pytest.mark.parametrize(
    ("version", "body_length", "accepted"),
    [
        (0, PREAMBLE_BODY_V1_SIZE, False),
        (1, PREAMBLE_BODY_V1_SIZE - 1, False),
        (1, MAX_PREAMBLE_BODY + 1, False),
        (1, 0xFFFF, False),
        (1, MAX_PREAMBLE_BODY, True),
        (0xFFFF, PREAMBLE_BODY_V1_SIZE, True),
    ],
)
def test_preamble_head_checked_before_body(version: int, body_length: int, accepted: bool):
    head = MAGIC + struct.pack("!HH", version, body_length)
    decoder = FrameDecoder()
    decoder.feed(head)
    if not accepted:
        with pytest.raises(RemoteProtocolError):
            decoder.next_handshake()
        return
    assert decoder.next_handshake() is None
    body = encode_preamble(CUSTOM_LIMITS)[PREAMBLE_FIXED_SIZE:]
    decoder.feed(body.ljust(body_length, b"\xee"))
    # (a version-1 peer's extra body bytes are ignored; from version 2 they are
    # capability entries, which 0xee bytes are not)
    expected = Handshake(min(version, 2), CUSTOM_LIMITS)
    assert decoder.next_handshake() == expected


def test_limits_are_inclusive_and_checked_on_the_header(vectors: dict[str, bytes]):
    def receiver(limits: Limits) -> FrameDecoder:
        decoder = FrameDecoder(limits)
        decoder.feed(vectors["preamble-default"])
        assert decoder.next_handshake() is not None
        return decoder

    hello = vectors["frames-hello-empty"]
    exact = Limits(max_frames=2, max_frame_size=5, max_message_size=5)
    decoder = receiver(exact)
    decoder.feed(hello)
    assert decoder.next_message() == [b"hello", b""]

    # The frame count alone is enough to reject a message.
    decoder = receiver(dataclasses.replace(exact, max_frames=1))
    decoder.feed(hello[:4])
    with pytest.raises(RemoteProtocolError, match="frames"):
        decoder.next_message()
    # The length table is enough to reject oversized frames and messages.
    for limits in (
        dataclasses.replace(exact, max_frame_size=4),
        dataclasses.replace(exact, max_message_size=4),
    ):
        decoder = receiver(limits)
        decoder.feed(hello[:20])
        with pytest.raises(RemoteProtocolError, match="exceeds the limit"):
            decoder.next_message()


@pytest.mark.parametrize("name", ["frames-hello-empty", "frames-zero", "message-oob"])
def test_end_of_stream_inside_a_message_is_truncation(vectors: dict[str, bytes], name: str):
    vector = vectors[name]
    for cut in range(1, len(vector)):
        decoder = FrameDecoder()
        decoder.feed(vectors["preamble-default"])
        assert decoder.next_handshake() is not None
        decoder.feed(vector[:cut])
        assert decoder.next_message() is None
        decoder.receive_eof()
        with pytest.raises(EndOfData) as exc_info:
            decoder.next_message()
        assert exc_info.value.truncated


def test_end_of_stream_inside_the_preamble_is_truncation(vectors: dict[str, bytes]):
    preamble = vectors["preamble-default"]
    for cut in range(len(preamble)):
        decoder = FrameDecoder()
        decoder.feed(preamble[:cut])
        assert decoder.next_handshake() is None
        decoder.receive_eof()
        with pytest.raises(EndOfData) as exc_info:
            decoder.next_handshake()
        assert exc_info.value.truncated


def test_pickle_reference_example(doc: str):
    assert "`D7 02 00 00 00 00 00 00 00 01`" in doc
    payload = bytes.fromhex("D7 02 00 00 00 00 00 00 00 01")
    assert payload[1] == EXT_PICKLE
    assert struct.unpack("!2I", payload[2:]) == (0, 1)
    with pytest.raises(RemoteProtocolError, match="pickle is not enabled"):
        Serializer().loads([memoryview(payload), memoryview(b"x"), memoryview(b"y")])


_SENDER_DEPTH_SCRIPT = """
import sys
from anyio_comm import SerializationError
from anyio_comm._sansio.serialization import Serializer

deepest = int(sys.argv[1])
value = []
for _ in range(deepest - 1):
    value = [value]
Serializer().dumps(value)  # nested `deepest` deep
try:
    Serializer().dumps([value])  # one more
except SerializationError:
    print(deepest, deepest + 1)
"""


@pytest.mark.skipif(
    sys.implementation.name != "cpython"
    or sys.version_info[:2] != (3, 11)
    or msgpack.version < (1, 2)
    or sys.getrecursionlimit() != 1000,
    reason="the figure the specification gives is for CPython 3.11 and msgpack 1.2",
)
def test_sender_depth_figure(doc: str):
    text = " ".join(doc.split())
    assert (
        "With CPython 3.11, its default recursion limit of 1000 and msgpack 1.2, "
        "`Serializer.dumps` called from the top level of a script encodes lists nested "
        "998 deep and raises at 999" in text
    )
    assert (
        "The build compiled with mypyc (`ANYIO_COMM_MYPYC=1`) encodes lists nested 1024 "
        "deep there, the limit, and raises at 1025." in text
    )
    # the form this session imported: pure Python, or compiled (tests/test_build.py)
    deepest = "1024" if compiled_modules() else "998"
    package = Path(__import__("anyio_comm").__file__).parents[1]
    result = subprocess.run(
        [sys.executable, "-c", _SENDER_DEPTH_SCRIPT, deepest],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(package)},
        cwd=package,  # python -c imports from its working directory first
        timeout=60,
    )
    assert result.stdout.split() == [deepest, str(int(deepest) + 1)]


# -- rejected inputs ---------------------------------------------------------


def preamble_default() -> bytes:
    return encode_preamble(Limits())


@pytest.mark.parametrize(
    "name", sorted(name for name in EXPECTED_REJECTS if not name.startswith("message-"))
)
def test_reject_frames_layer(
    rejects: dict[str, bytes], notes: dict[str, re.Match[str]], name: str
):
    vector = rejects[name]
    limits, _ = receiver_of(notes[name])
    if name.startswith("close-"):
        assert "having announced `CAP_CLOSE_REASONS`" in notes[name]["receiver"]
    if name.startswith("compressed-"):
        pytest.importorskip("cramjam")
        assert "having announced `CAP_COMPRESSION` with `lz4`" in notes[name]["receiver"]
    decoder = FrameDecoder(
        limits,
        capabilities=CLOSE if name.startswith("close-") else frozenset(),
        compression=("lz4",) if name.startswith("compressed-") else (),
    )
    if name.startswith("preamble-"):
        step = decoder.next_handshake
    else:
        decoder.feed(preamble_default())
        assert decoder.next_handshake() is not None
        step = decoder.next_message  # type: ignore[assignment]
    # Every byte but the last is a valid beginning: nothing fails before it.
    for i in range(len(vector) - 1):
        decoder.feed(vector[i : i + 1])
        assert step() is None, f"{name}: failed at byte {i + 1}"
    decoder.feed(vector[-1:])
    if "truncated" in name:
        assert step() is None
        decoder.receive_eof()
        with pytest.raises(EndOfData) as exc_info:
            step()
        assert exc_info.value.truncated
    else:
        # Detected at the last byte, without waiting for more.
        with pytest.raises(RemoteProtocolError):
            step()
    # The error is final: every later call raises it again.
    with pytest.raises((RemoteProtocolError, EndOfData)):
        step()


@pytest.mark.parametrize("name", sorted(REJECT_ERRORS))
def test_reject_message_layer(
    rejects: dict[str, bytes], notes: dict[str, re.Match[str]], name: str
):
    limits, allow_pickle = receiver_of(notes[name])
    assert limits == Limits()
    # A valid message of the frames layer, whole, nothing left over...
    decoder = FrameDecoder(limits)
    decoder.feed(preamble_default())
    assert decoder.next_handshake() is not None
    decoder.feed(rejects[name])
    frames = decoder.next_message()
    assert frames is not None
    assert decoder.at_message_boundary
    # ... that the message layer rejects, for the stated reason.
    with pytest.raises(RemoteProtocolError, match=REJECT_ERRORS[name]):
        Serializer(allow_pickle=allow_pickle).loads(frames)
