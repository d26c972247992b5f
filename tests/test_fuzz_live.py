"""A live listener against hostile raw clients, on every backend.

Raw sockets send random bytes, a valid preamble followed by random bytes,
valid traffic, valid traffic with bit flips, byte insertions and deletions,
truncation and oversized counts or lengths, or valid frames whose bodies break
the message layer; then they close at once, half-close, or wait for the
listener to hang up. The sans-IO decoder and serializer, run on the same
bytes, predict what the listener does with them: which messages it echoes,
whether it ends the connection by itself (a protocol error), and which error
it logs. Afterwards the listener still serves a correct client, counts no
connection, logged nothing above DEBUG, never had to fall back on its
handshake timeout, and holds no extra file descriptor or task.

Cases come from ``random.Random(seed)``. The seed is fixed by default, so a
run is reproducible; ``ANYIO_COMM_FUZZ_SEED=random`` draws a fresh one (to
fuzz more cases over many runs), and ``ANYIO_COMM_FUZZ_SEED=<seed>`` replays
a run. The seed is in every failure message.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import pickle
import random
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from anyio import BrokenResourceError, EndOfStream

import anyio_comm
from anyio_comm import (
    Comm,
    Limits,
    LocalProtocolError,
    RemoteProtocolError,
    SerializationError,
)
from anyio_comm._sansio.decoder import EndOfData, FrameDecoder
from anyio_comm._sansio.serialization import EXT_OOB, EXT_PICKLE, Serializer
from anyio_comm._sansio.wire import Capability, Handshake, encode_header, encode_preamble

from .certs import client_context, server_context
from .conftest import HAVE_UNIX
from .decoding import normalize, receive_into
from .helpers import open_fds, running_tasks, temp_unix_address

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from anyio.abc import ByteStream

#: the listener's receive limits: small, so mutated lengths often break them
LISTENER_LIMITS = Limits(max_frames=16, max_frame_size=64 * 1024, max_message_size=256 * 1024)
PREAMBLE = encode_preamble(Limits())
CONCURRENCY = 6
#: generous bound on any single wait, only there to turn a hang into a failure
BOUND = 15


DEFAULT_SEED = 20261122


def fuzz_seed() -> int:
    value = os.environ.get("ANYIO_COMM_FUZZ_SEED", "")
    if value == "random":
        return random.randrange(2**32)
    return int(value) if value else DEFAULT_SEED


async def wait_until(condition: Callable[[], bool], what: str, seed: int) -> None:
    with anyio.move_on_after(BOUND):
        while not condition():
            await anyio.sleep(0.01)
        return
    pytest.fail(f"{what} (seed {seed})")


async def discard_until_closed(stream: ByteStream) -> None:
    """Read and drop what the listener sends until it closes the connection."""
    with anyio.fail_after(BOUND):
        try:
            while await stream.receive():
                pass
        except (EndOfStream, BrokenResourceError):
            pass


# -- building traffic ----------------------------------------------------------


def ext(code: int, payload: bytes) -> bytes:
    """A msgpack extension value (ext 8) with any type code and payload."""
    return bytes([0xC7, len(payload)]) + struct.pack("!b", code) + payload


def encode_message(frames: Sequence[bytes]) -> bytes:
    return encode_header([len(f) for f in frames]) + b"".join(frames)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randint(-(2**63), 2**64 - 1)
    if kind == 2:
        return rng.uniform(-1e9, 1e9)
    if kind == 3:
        return "".join(rng.choice("aZ é€\U0001d11e") for _ in range(rng.randrange(12)))
    if kind in (4, 5):
        return rng.randbytes(rng.choice([0, 3, 100, 4095, 4096, 6000]))
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7:
        return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randrange(4))}
    return {rng.randbytes(3): random_value(rng, depth + 1)}


def hostile_body(rng: random.Random, n_oob: int) -> bytes:
    """A body frame that breaks the message layer (or, rarely, happens not to)."""
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 40))
    if kind == 1:  # an extension type nobody defined
        return ext(rng.choice([-128, -2, 0, 3, 42, 127]), rng.randbytes(rng.randrange(9)))
    if kind == 2:  # an out-of-band reference past the frames there are
        return ext(EXT_OOB, struct.pack("!I", rng.choice([n_oob, n_oob + 1, 2**32 - 1])))
    if kind == 3:  # pickle, which the listener did not enable
        return ext(EXT_PICKLE, struct.pack("!I", 0))
    if kind == 4:  # nesting deeper than the decoder accepts
        return b"\x91" * rng.choice([1025, 5000]) + b"\xc0"
    if kind == 5:  # a declared length far past the end of the body
        return bytes([rng.choice([0xC6, 0xDB, 0xDD, 0xDF])]) + b"\xff\xff\xff\xff"
    return b"\x81\x01\x02"  # an integer map key


def header_fields(messages: Sequence[Sequence[bytes]], start: int) -> list[tuple[int, int]]:
    """(offset, width) of every count and length field of the encoded messages."""
    fields = []
    for frames in messages:
        fields.append((start, 4))
        fields += [(start + 4 + 8 * k, 8) for k in range(len(frames))]
        start += 4 + 8 * len(frames) + sum(len(f) for f in frames)
    return fields


def mutate(rng: random.Random, data: bytes, fields: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(["flip", "flip", "insert", "delete", "truncate", "length", "count"])
        if op in ("length", "count") and fields:
            offset, width = rng.choice(fields)
            if offset + width <= len(out):
                big = rng.choice(
                    [LISTENER_LIMITS.max_frames + 1, 2**31, 2**32 - 1]
                    if width == 4
                    else [LISTENER_LIMITS.max_frame_size + 1, 2**40, 2**63, 2**64 - 1]
                )
                out[offset : offset + width] = big.to_bytes(width, "big")
        elif op == "insert":
            out.insert(rng.randrange(len(out) + 1), rng.randrange(256))
        elif not out:
            continue
        elif op == "flip":
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        elif op == "delete":
            del out[rng.randrange(len(out))]
        else:
            del out[rng.randrange(len(out)) :]
    return bytes(out)


def make_payload(rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choices(
        ["random", "preamble+random", "valid", "mutated", "bad-bodies"], [3, 3, 2, 8, 3]
    )[0]
    if kind == "random":
        return kind, rng.randbytes(rng.choice([0, 1, 7, 12, 32, 100, 3000]))
    if kind == "preamble+random":
        return kind, PREAMBLE + rng.randbytes(rng.choice([1, 4, 12, 100, 3000]))
    # (values of 4 KiB and more out-of-band, as a sender may choose: the listener
    # decodes both forms, and answers with its own default)
    serializer = Serializer(oob_threshold=4096)
    messages = [
        [bytes(f) for f in serializer.dumps(random_value(rng))] for _ in range(rng.randint(1, 4))
    ]
    if kind == "bad-bodies":
        n_oob = rng.randrange(3)
        messages.insert(
            rng.randrange(len(messages) + 1),
            [hostile_body(rng, n_oob), *(rng.randbytes(5) for _ in range(n_oob))],
        )
    stream = PREAMBLE + b"".join(encode_message(m) for m in messages)
    if kind == "mutated":
        stream = mutate(rng, stream, header_fields(messages, len(PREAMBLE)))
    return kind, stream


# -- predicting the listener ---------------------------------------------------


@dataclass
class Prediction:
    #: the messages the echo handler sends back, in order
    echoes: list[Any]
    #: the listener ends the connection by itself, without our EOF
    closes: bool
    #: the exception the listener logs for this connection (None: nothing)
    logged: str | None
    #: the listener's handler ran and returned normally (a graceful close)
    graceful: bool = False


def predict(payload: bytes, *, eof: bool) -> Prediction:
    """Run the listener's decoder, serializer and echo handler on ``payload``."""
    decoder = FrameDecoder(LISTENER_LIMITS, capabilities=frozenset({Capability.CLOSE_REASONS}))
    serializer = Serializer()
    handshake: Handshake | None = None
    echoes: list[Any] = []
    rest = memoryview(payload)
    for _ in range(len(payload) + len(payload) // 4 + 4):
        try:
            if handshake is None:
                handshake = decoder.next_handshake()
                progress = handshake is not None
            else:
                frames = decoder.next_message()
                progress = frames is not None
                if frames is not None:
                    value = serializer.loads(frames)
                    try:  # what echo() does with it
                        reply = serializer.dumps(value)
                        handshake.limits.check_send([f.nbytes for f in reply])
                    except (SerializationError, LocalProtocolError):
                        return Prediction(echoes, True, None, graceful=True)
                    echoes.append(normalize(value))
        except RemoteProtocolError:
            return Prediction(echoes, True, "RemoteProtocolError")
        except EndOfData as exc:
            if exc.truncated:  # in the handshake or inside a message
                return Prediction(echoes, False, "BrokenResourceError")
            return Prediction(echoes, False, None, graceful=True)
        if progress:
            continue
        if not rest:
            if not eof:
                return Prediction(echoes, False, None)
            decoder.receive_eof()
            continue
        rest = receive_into(decoder, rest)
    raise AssertionError("the decoder made no progress")


def parse_reply(reply: bytes) -> tuple[Handshake | None, list[Any]]:
    """The listener's preamble and the complete messages it sent back."""
    decoder = FrameDecoder()
    decoder.feed(reply[:1036])
    handshake = decoder.next_handshake()
    if handshake is None:
        return None, []
    messages = []
    rest = memoryview(reply)[1036:]
    while True:
        frames = decoder.next_message()
        if frames is not None:
            messages.append(normalize(Serializer().loads(frames)))
            continue
        if not rest:
            return handshake, messages
        rest = receive_into(decoder, rest)


# -- the listener side ---------------------------------------------------------


async def echo(comm: Comm) -> None:
    try:
        async for message in comm:
            await comm.send(message)
    except (LocalProtocolError, SerializationError):
        # a value the echo cannot send back: a mutated preamble announced tiny
        # limits, or msgpack cannot re-encode what it decoded
        return


async def check_serving(address: str, rng: random.Random, seed: int, **options: Any) -> None:
    """A correct client still gets its checksummed payloads back intact."""
    with anyio.fail_after(BOUND):
        async with await anyio_comm.connect(address, timeout=BOUND, **options) as comm:
            for i in range(4):
                data = rng.randbytes(rng.choice([0, 100, 4095, 4096, 50_000]))
                digest = hashlib.sha256(data).hexdigest()
                await comm.send({"i": i, "data": data, "sha256": digest})
                reply = await comm.receive()
                assert reply["i"] == i, seed
                assert reply["sha256"] == digest, seed
                assert hashlib.sha256(reply["data"]).hexdigest() == digest, f"seed {seed}"


# -- the raw client side -------------------------------------------------------


@dataclass
class Case:
    index: int
    kind: str
    payload: bytes
    ending: str  # "close", "half-close" or "wait" (for the listener to hang up)
    prediction: Prediction
    port: int | None = None

    def describe(self, seed: int) -> str:
        head = self.payload[:48].hex()
        return (
            f"seed {seed}, case {self.index} ({self.kind}, {self.ending}, "
            f"{len(self.payload)} bytes: {head}...)"
        )


def make_case(rng: random.Random, index: int, *, can_half_close: bool = True) -> Case:
    kind, payload = make_payload(rng)
    waiting = predict(payload, eof=False)
    endings = ["close"]
    if waiting.closes:
        endings += ["wait", "wait"]
    if can_half_close:
        endings += ["half-close", "half-close"]
    ending = rng.choice(endings)
    prediction = waiting if ending != "half-close" else predict(payload, eof=True)
    return Case(index, kind, payload, ending, prediction)


async def run_case(connect: Callable[[], Awaitable[ByteStream]], case: Case, seed: int) -> None:
    where = case.describe(seed)
    with anyio.fail_after(BOUND):
        stream = await connect()
    async with stream:
        local = stream.extra(anyio.abc.SocketAttribute.local_address, None)
        if isinstance(local, tuple):
            case.port = local[1]
        try:
            if case.payload:
                await stream.send(case.payload)
            if case.ending == "half-close":
                await stream.send_eof()
        except BrokenResourceError:
            pass  # the listener hung up first
        except OSError as exc:
            # ... with a reset (it rejected a preamble before reading all that was
            # sent), which AnyIO's send_eof() on trio raises as the socket's error
            if exc.errno != errno.ENOTCONN:
                raise
        if case.ending == "close":
            return
        reply = bytearray()
        with anyio.move_on_after(BOUND) as scope:
            try:
                while True:
                    reply += await stream.receive()
            except (EndOfStream, BrokenResourceError):
                pass
        assert not scope.cancelled_caught, f"the listener never closed the connection: {where}"
    handshake, echoed = parse_reply(bytes(reply))
    if reply:
        assert handshake == Handshake(2, LISTENER_LIMITS, frozenset({Capability.CLOSE_REASONS})), (
            where
        )
    expected = case.prediction.echoes
    assert echoed == expected[: len(echoed)], where
    if case.prediction.graceful:  # nothing was cut short: every echo arrived
        assert echoed == expected, where


async def warm_up() -> None:
    """Reach the event loop's steady state before counting file descriptors: the
    first connection the listener drops makes uvloop open one descriptor (on
    /dev/null) that it keeps for the rest of the loop's life."""
    async with anyio_comm.listen("tcp://127.0.0.1:0", echo, handshake_timeout=2) as listener:
        stream = await tcp_connect(listener.address)
        async with stream:
            await stream.send(b"not the protocol")
            await discard_until_closed(stream)


async def fuzz_listener(
    address: str,
    connect: Callable[[str], Awaitable[ByteStream]],
    cases: int,
    caplog: pytest.LogCaptureFixture,
    *,
    can_half_close: bool = True,
    per_connection_logs: bool = True,
    **options: Any,
) -> None:
    seed = fuzz_seed()
    rng = random.Random(seed)
    await warm_up()
    fds_before = open_fds()
    tasks_before = running_tasks()
    todo = [make_case(rng, i, can_half_close=can_half_close) for i in range(cases)]
    async with anyio_comm.listen(
        address, echo, handshake_timeout=2, limits=LISTENER_LIMITS, **options
    ) as listener:
        client_options = {"ssl_context": client_context()} if "ssl_context" in options else {}
        await check_serving(listener.address, rng, seed, **client_options)
        await wait_until(lambda: listener.active_connections == 0, "connection leak", seed)
        # the steady state (at most: the correct client's connection may still
        # be finishing); after leaving listen() the counts are checked exactly
        fds_idle, tasks_idle = open_fds(), running_tasks()

        limiter = anyio.CapacityLimiter(CONCURRENCY)

        async def one(case: Case) -> None:
            async with limiter:
                await run_case(lambda: connect(listener.address), case, seed)

        with caplog.at_level(logging.DEBUG, logger="anyio_comm"):
            async with anyio.create_task_group() as tg:
                for case in todo:
                    tg.start_soon(one, case)
            await wait_until(
                lambda: listener.active_connections == 0, "connections still counted", seed
            )
            await wait_until(lambda: running_tasks() <= tasks_idle, "task leak", seed)
            await wait_until(lambda: open_fds() <= fds_idle, "file descriptor leak", seed)
        await check_serving(listener.address, rng, seed, **client_options)

    await wait_until(lambda: open_fds() == fds_before, "file descriptor leak after close", seed)
    await wait_until(lambda: running_tasks() == tasks_before, "task leak after close", seed)

    ours = [r for r in caplog.records if r.name == "anyio_comm"]
    assert not [r.getMessage() for r in ours if r.levelno > logging.DEBUG], f"seed {seed}"
    # every connection ended by the client's doing or by a detected error,
    # never by the handshake timeout
    assert not [r for r in ours if "TimeoutError" in r.getMessage()], f"seed {seed}"
    if not per_connection_logs:
        return
    ports = [case.port for case in todo]
    for case in todo:
        if case.ending == "close" or case.port is None or ports.count(case.port) > 1:
            continue
        peer = re.compile(rf"127\.0\.0\.1:{case.port}(?!\d)")
        messages = [r.getMessage() for r in ours if peer.search(r.getMessage())]
        where = case.describe(seed)
        if case.prediction.logged is None:
            assert messages == [], where
        else:
            assert len(messages) == 1, (where, messages)
            assert case.prediction.logged in messages[0], (where, messages)


async def tcp_connect(address: str) -> ByteStream:
    host, port = address[len("tcp://") :].rsplit(":", 1)
    return await anyio.connect_tcp(host, int(port))


async def unix_connect(address: str) -> ByteStream:
    return await anyio.connect_unix(address[len("unix://") :])


async def tls_connect(address: str) -> ByteStream:
    host, port = address[len("tls://") :].rsplit(":", 1)
    return await anyio.connect_tcp(
        host,
        int(port),
        ssl_context=client_context(),
        tls_standard_compatible=False,  # a close without close_notify: no unwrap wait
    )


async def test_hostile_tcp_clients(caplog: pytest.LogCaptureFixture) -> None:
    await fuzz_listener("tcp://127.0.0.1:0", tcp_connect, 60, caplog)


@pytest.mark.skipif(not HAVE_UNIX, reason="no Unix sockets")
async def test_hostile_unix_clients(caplog: pytest.LogCaptureFixture) -> None:
    async with temp_unix_address() as address:
        await fuzz_listener(address, unix_connect, 20, caplog, per_connection_logs=False)


async def test_hostile_tls_clients(caplog: pytest.LogCaptureFixture) -> None:
    """Fuzz inside TLS sessions (no half-close: anyio's TLS streams cannot)."""
    await fuzz_listener(
        "tls://127.0.0.1:0",
        tls_connect,
        12,
        caplog,
        can_half_close=False,
        ssl_context=server_context(),
    )


async def test_plaintext_to_a_tls_listener(caplog: pytest.LogCaptureFixture) -> None:
    """Raw bytes where a TLS ClientHello should be: the TLS handshake fails, the
    connection is dropped without waiting for the handshake timeout."""
    seed = fuzz_seed()
    rng = random.Random(seed)
    await warm_up()
    fds_before = open_fds()
    with caplog.at_level(logging.DEBUG, logger="anyio_comm"):
        async with anyio_comm.listen(
            "tls://127.0.0.1:0", echo, handshake_timeout=2, ssl_context=server_context()
        ) as listener:
            host, port = listener.address[len("tls://") :].rsplit(":", 1)
            for payload in [PREAMBLE, b"GET / HTTP/1.1\r\n\r\n", rng.randbytes(300), b"\x16\x03"]:
                stream = await anyio.connect_tcp(host, int(port))
                async with stream:
                    await stream.send(payload)
                    await stream.send_eof()
                    await discard_until_closed(stream)
            await check_serving(listener.address, rng, seed, ssl_context=client_context())
            await wait_until(lambda: listener.active_connections == 0, "connection leak", seed)
    assert open_fds() == fds_before
    ours = [r for r in caplog.records if r.name == "anyio_comm"]
    assert not [r for r in ours if r.levelno > logging.DEBUG]
    assert not [r for r in ours if "TimeoutError" in r.getMessage()]


# -- message-layer violations over a real connection ---------------------------

#: what unpickling a Detonator did; empty unless something was unpickled
UNPICKLED: list[str] = []


def record_unpickling(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class Detonator:
    """Unpickling this calls record_unpickling: the side effect tells that it happened."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return record_unpickling, ("unpickled",)


def pickled_detonator() -> list[bytes]:
    return [bytes(f) for f in Serializer(allow_pickle=True).dumps({"x": Detonator()})]


BAD_MESSAGES: dict[str, Callable[[], list[bytes]]] = {
    "never-used-type-byte": lambda: [b"\xc1"],
    "truncated-body": lambda: [b"\x92\x01"],
    "trailing-bytes": lambda: [b"\x01\x02"],
    "bad-utf8": lambda: [b"\xa2\xff\xfe"],
    "integer-map-key": lambda: [b"\x81\x01\x02"],
    "depth-bomb": lambda: [b"\x91" * 3000 + b"\xc0"],
    "huge-declared-length": lambda: [b"\xdd\xff\xff\xff\xff\xc0"],
    "unknown-ext": lambda: [ext(5, b"abcd")],
    "oob-out-of-range": lambda: [ext(EXT_OOB, struct.pack("!I", 1)), b"only frame 0"],
    "oob-huge-index": lambda: [ext(EXT_OOB, b"\xff\xff\xff\xff")],
    "oob-bad-size": lambda: [ext(EXT_OOB, b"\x00\x00"), b"x"],
    "no-body-frame": list,
    "pickle-without-opt-in": pickled_detonator,
}


async def recording_listener_roundtrip(
    frames: list[bytes], *, allow_pickle: bool
) -> tuple[list[Any], list[BaseException]]:
    """Send a good message then ``frames`` from a raw client; return what the
    handler received and the errors its receive raised."""
    received: list[Any] = []
    errors: list[BaseException] = []
    done = anyio.Event()

    async def recorder(comm: Comm) -> None:
        if done.is_set():  # a later, correct client: just echo
            await echo(comm)
            return
        try:
            async for message in comm:
                received.append(normalize(message))
                await comm.send(message)
        except Exception as exc:
            errors.append(exc)
            raise
        finally:
            done.set()

    async with anyio_comm.listen(
        "tcp://127.0.0.1:0", recorder, handshake_timeout=2, allow_pickle=allow_pickle
    ) as listener:
        stream = await tcp_connect(listener.address)
        async with stream:
            await stream.send(PREAMBLE + encode_message([b"\xa6before"]) + encode_message(frames))
            if allow_pickle:
                await stream.send_eof()
            await discard_until_closed(stream)  # the listener closes the connection by itself
        with anyio.fail_after(BOUND):
            await done.wait()
        await check_serving(listener.address, random.Random(0), 0, allow_pickle=allow_pickle)
        await wait_until(lambda: listener.active_connections == 0, "connection leak", 0)
    return received, errors


@pytest.mark.parametrize("case", list(BAD_MESSAGES))
async def test_message_layer_violation_closes_the_connection(case: str) -> None:
    UNPICKLED.clear()
    received, errors = await recording_listener_roundtrip(BAD_MESSAGES[case](), allow_pickle=False)
    assert received == ["before"]
    assert len(errors) == 1 and isinstance(errors[0], RemoteProtocolError), errors
    assert UNPICKLED == []


async def test_pickle_payload_runs_when_opted_in() -> None:
    """Positive control: the same payload, to a listener that enabled pickle."""
    UNPICKLED.clear()
    received, errors = await recording_listener_roundtrip(pickled_detonator(), allow_pickle=True)
    assert received == ["before", {"x": "unpickled"}]
    assert errors == []
    assert UNPICKLED == ["unpickled"]
    UNPICKLED.clear()


def test_pickled_detonator_references_this_module() -> None:
    """The pickle stream names record_unpickling in this module, so unpickling it
    in the listener's process runs the recorded side effect."""
    stream = pickled_detonator()[1]
    assert b"record_unpickling" in stream
    assert pickle.loads(stream) == "unpickled"
    assert UNPICKLED == ["unpickled"]
    UNPICKLED.clear()
