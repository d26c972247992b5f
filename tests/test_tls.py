"""tls:// addresses: option checks, verification failures, mTLS, attributes, ragged EOF.

Every test runs on TLS 1.2 and TLS 1.3 (the ``tls_version`` fixture) and, through
``anyio_backend``, on asyncio, uvloop and trio.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import random
import ssl
import threading
import time
import tracemalloc
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import trustme
from anyio import BrokenResourceError, EndOfStream
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.tls import TLSAttribute, TLSStream

import anyio_comm
from anyio_comm import Comm, Limits, RemoteProtocolError
from anyio_comm._sansio.connection import DEFAULT_READ_BUFFER_SIZE
from anyio_comm._sansio.wire import encode_header, encode_preamble
from anyio_comm._transports.tls import CHUNK, FIRST_CIPHER_BUFFER

from .certs import client_context, expired_server_cert, server_cert, server_context

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from _pytest.logging import LogCaptureFixture

PREAMBLE_SIZE = 32  # encode_preamble(Limits()) on the wire


@pytest.fixture(params=[ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["tls1.2", "tls1.3"])
def tls_version(request: pytest.FixtureRequest) -> ssl.TLSVersion:
    return request.param  # type: ignore[no-any-return]


async def echo(comm: Comm) -> None:
    async for message in comm:
        await comm.send(message)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


async def assert_round_trip(address: str, ctx: ssl.SSLContext, **kwargs: Any) -> None:
    """A correct client connects to the echo listener at ``address`` and gets its message back."""
    with anyio.fail_after(10):
        async with await anyio_comm.connect(
            address, ssl_context=ctx, timeout=10, **kwargs
        ) as comm:
            await comm.send({"still": "serving"})
            assert await comm.receive() == {"still": "serving"}


async def wait_for_debug_log(caplog: LogCaptureFixture) -> None:
    """The listener logged the dropped connection at DEBUG on ``anyio_comm``, and nothing worse."""
    with anyio.fail_after(5):
        while not any(
            r.name == "anyio_comm" and r.levelno == logging.DEBUG for r in caplog.records
        ):
            await anyio.sleep(0.01)
    # (only our logger: asyncio's debug mode, on under `python -X dev`, warns
    # about slow callbacks such as certificate generation)
    assert not [
        r for r in caplog.records if r.name == "anyio_comm" and r.levelno >= logging.WARNING
    ]


@asynccontextmanager
async def tls_pair(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, **connect_kwargs: Any
) -> AsyncIterator[tuple[Comm, Comm]]:
    """Yield ``(client, server)`` comms connected over ``tls://127.0.0.1``."""
    send, receive = anyio.create_memory_object_stream[Comm](1)
    done = anyio.Event()

    async def handler(comm: Comm) -> None:
        await send.send(comm)
        await done.wait()

    async with send, receive:
        async with anyio_comm.listen("tls://127.0.0.1:0", handler, ssl_context=server_ctx) as lst:
            assert lst.address.startswith("tls://127.0.0.1:") and port_of(lst.address) != 0
            client = await anyio_comm.connect(
                lst.address, ssl_context=client_ctx, timeout=10, **connect_kwargs
            )
            try:
                async with client:
                    with anyio.fail_after(10):
                        server = await receive.receive()
                    yield client, server
            finally:
                done.set()


# --- options -----------------------------------------------------------------------------


async def test_tls_without_ssl_context_is_a_value_error(tls_version: ssl.TLSVersion) -> None:
    """No silent fallback to a default context: connect and listen both refuse."""
    with pytest.raises(ValueError, match="ssl_context"):
        await anyio_comm.connect("tls://127.0.0.1:1", timeout=5)
    with pytest.raises(ValueError, match="ssl_context"):
        async with anyio_comm.listen("tls://127.0.0.1:0", echo):
            pass


@pytest.mark.parametrize(
    ("connect_address", "listen_address"),
    [
        ("tcp://127.0.0.1:1", "tcp://127.0.0.1:0"),
        ("unix:///tmp/acomm-nobody.sock", "unix:///tmp/acomm-nobody.sock"),
        ("inproc://nobody", "inproc://"),
    ],
    ids=["tcp", "unix", "inproc"],
)
async def test_ssl_context_with_a_plaintext_scheme_is_a_value_error(
    tls_version: ssl.TLSVersion, connect_address: str, listen_address: str
) -> None:
    """Refused up front: nobody listens at these addresses, so no other error can come first."""
    with pytest.raises(ValueError):
        await anyio_comm.connect(
            connect_address, ssl_context=client_context(tls_version), timeout=5
        )
    with pytest.raises(ValueError):
        async with anyio_comm.listen(
            listen_address, echo, ssl_context=server_context(tls_version)
        ):
            pass


# --- working connections -----------------------------------------------------------------


async def test_round_trip_and_tls_attributes_on_both_sides(tls_version: ssl.TLSVersion) -> None:
    """comm.extra() answers TLSAttribute and SocketAttribute on the client and the server."""
    expected_version = {ssl.TLSVersion.TLSv1_2: "TLSv1.2", ssl.TLSVersion.TLSv1_3: "TLSv1.3"}
    server_der = ssl.PEM_cert_to_DER_cert(server_cert().cert_chain_pems[0].bytes().decode())
    async with tls_pair(server_context(tls_version), client_context(tls_version)) as pair:
        client, server = pair
        with anyio.fail_after(10):
            await client.send({"hello": [1, 2, 3]})
            assert await server.receive() == {"hello": [1, 2, 3]}
            await server.send(b"back")
            assert await client.receive() == b"back"

        for comm, server_side in ((client, False), (server, True)):
            assert comm.extra(TLSAttribute.server_side) is server_side
            assert comm.extra(TLSAttribute.tls_version) == expected_version[tls_version]
            cipher = comm.extra(TLSAttribute.cipher)
            assert isinstance(cipher, tuple) and len(cipher) == 3
            assert comm.extra(TLSAttribute.alpn_protocol) is None
            ssl_object = comm.extra(TLSAttribute.ssl_object)
            assert isinstance(ssl_object, (ssl.SSLObject, ssl.SSLSocket))
            assert ssl_object.version() == expected_version[tls_version]
        assert client.extra(TLSAttribute.cipher) == server.extra(TLSAttribute.cipher)

        # the client sees the server's certificate
        peer_cert = client.extra(TLSAttribute.peer_certificate)
        assert ("DNS", "localhost") in peer_cert["subjectAltName"]
        assert client.extra(TLSAttribute.peer_certificate_binary) == server_der

        # socket attributes still describe the TCP connection under TLS
        assert client.extra(SocketAttribute.remote_port) == port_of(client.peer_address)
        assert server.extra(SocketAttribute.remote_port) == client.extra(
            SocketAttribute.local_port
        )


async def test_alpn_protocol_is_negotiated_when_both_sides_ask(
    tls_version: ssl.TLSVersion,
) -> None:
    server_ctx, client_ctx = server_context(tls_version), client_context(tls_version)
    server_ctx.set_alpn_protocols(["acomm"])
    client_ctx.set_alpn_protocols(["acomm"])
    async with tls_pair(server_ctx, client_ctx) as (client, server):
        assert client.extra(TLSAttribute.alpn_protocol) == "acomm"
        assert server.extra(TLSAttribute.alpn_protocol) == "acomm"


async def test_20mb_memoryview_round_trips_intact(tls_version: ssl.TLSVersion) -> None:
    """An out-of-band frame far larger than any TLS record or read buffer survives both ways."""
    payload = memoryview(bytes(range(256)) * (20 * 1024 * 1024 // 256))
    async with anyio_comm.listen(
        "tls://127.0.0.1:0", echo, ssl_context=server_context(tls_version)
    ) as listener:
        with anyio.fail_after(30):
            async with await anyio_comm.connect(
                listener.address, ssl_context=client_context(tls_version), timeout=10
            ) as comm:
                # an idle connection's ciphertext buffer is small ...
                assert comm._transport._cipher.nbytes == FIRST_CIPHER_BUFFER  # type: ignore[attr-defined]
                await comm.send({"data": payload, "n": 1})
                reply = await comm.receive()
                # ... and bulk data grows it to a full chunk
                assert comm._transport._cipher.nbytes == CHUNK  # type: ignore[attr-defined]
    assert reply["n"] == 1
    assert len(reply["data"]) == len(payload) and reply["data"] == payload


async def test_mutual_tls_server_sees_client_certificate_via_serve(
    tls_version: ssl.TLSVersion,
) -> None:
    """CERT_REQUIRED on the listener: the handler's comm carries the client's certificate."""
    server_ctx = server_context(tls_version, require_client_cert=True)
    seen: list[Any] = []

    async def handler(comm: Comm) -> None:
        seen.append(comm.extra(TLSAttribute.peer_certificate))
        seen.append(comm.extra(TLSAttribute.peer_certificate_binary))
        await echo(comm)

    async with anyio.create_task_group() as tg:
        start = functools.partial(anyio_comm.serve, ssl_context=server_ctx)
        listener = await tg.start(start, "tls://127.0.0.1:0", handler)
        await assert_round_trip(listener.address, client_context(tls_version, with_cert=True))
        tg.cancel_scope.cancel()
    client_cert, client_der = seen
    assert ("email", "client@example.org") in client_cert["subjectAltName"]
    assert isinstance(client_der, bytes) and client_der


async def test_server_hostname_and_check_hostname(tls_version: ssl.TLSVersion) -> None:
    """Verification uses the address host unless server_hostname or the context say otherwise."""
    server_ctx = server_context(tls_version, cert=server_cert("localhost"))
    async with anyio_comm.listen("tls://127.0.0.1:0", echo, ssl_context=server_ctx) as listener:
        port = port_of(listener.address)
        with anyio.fail_after(10), pytest.raises(ssl.SSLCertVerificationError):
            await anyio_comm.connect(
                listener.address, ssl_context=client_context(tls_version), timeout=10
            )
        await assert_round_trip(f"tls://localhost:{port}", client_context(tls_version))
        await assert_round_trip(
            listener.address, client_context(tls_version), server_hostname="localhost"
        )
        no_hostname_check = client_context(tls_version)
        no_hostname_check.check_hostname = False
        await assert_round_trip(listener.address, no_hostname_check)


# --- failing connections: the client gets an error, the listener keeps serving -------------


def _no_verification(version: ssl.TLSVersion) -> ssl.SSLContext:
    ctx = client_context(version)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


@pytest.mark.parametrize("case", ["untrusted-ca", "hostname-mismatch", "expired"])
async def test_certificate_verification_failures(
    tls_version: ssl.TLSVersion, case: str, caplog: LogCaptureFixture
) -> None:
    """connect raises SSLCertVerificationError; the listener drops that connection only."""
    caplog.set_level(logging.DEBUG, logger="anyio_comm")
    cert = {
        "untrusted-ca": server_cert(),
        "hostname-mismatch": server_cert("example.org"),
        "expired": expired_server_cert(),
    }[case]
    bad_client = client_context(tls_version, trust=(case != "untrusted-ca"))
    good_client, good_kwargs = client_context(tls_version), {}
    if case == "hostname-mismatch":
        good_kwargs = {"server_hostname": "example.org"}
    elif case == "expired":
        good_client = _no_verification(tls_version)

    server_ctx = server_context(tls_version, cert=cert)
    async with anyio_comm.listen("tls://127.0.0.1:0", echo, ssl_context=server_ctx) as listener:
        with anyio.fail_after(10), pytest.raises(ssl.SSLCertVerificationError) as caught:
            await anyio_comm.connect(listener.address, ssl_context=bad_client, timeout=10)
        await wait_for_debug_log(caplog)
        await assert_round_trip(listener.address, good_client, **good_kwargs)
    # The message names the address; OpenSSL's fields are all there.
    error = caught.value
    assert str(error).endswith(f" (TLS handshake with {listener.address})"), str(error)
    assert "certificate verify failed" in str(error) and "_ssl.c" not in str(error)
    assert "does not speak TLS" not in str(error)
    assert error.reason == "CERTIFICATE_VERIFY_FAILED" and error.library == "SSL"
    expected_code = {"untrusted-ca": 20, "hostname-mismatch": 64, "expired": 10}[case]
    assert error.verify_code == expected_code, error.verify_message
    assert error.verify_message and error.verify_message in str(error)
    assert error.errno == 1 and error.args == (1, str(error))
    assert error.__cause__ is None and error.__traceback__ is not None


def tls_failure_reason(error: BaseException) -> str:
    """The OpenSSL reason behind a failed connect or receive: the ``ssl.SSLError``
    itself (TLS 1.2: the client's handshake fails) or the one that caused a
    BrokenResourceError (TLS 1.3: the server's alert comes after the client's
    handshake completed)."""
    if isinstance(error, BrokenResourceError):
        error = error.__cause__  # type: ignore[assignment]
    assert isinstance(error, ssl.SSLError), repr(error)
    assert not isinstance(error, ssl.SSLEOFError), "the peer's alert was lost"
    return str(error.reason)


async def connect_and_receive(address: str, ctx: ssl.SSLContext) -> BaseException:
    """What connecting with ``ctx`` and receiving once raises."""
    with anyio.fail_after(10):
        try:
            async with await anyio_comm.connect(address, ssl_context=ctx, timeout=10) as comm:
                await comm.receive()
        except (ssl.SSLError, BrokenResourceError) as exc:
            return exc
    raise AssertionError("the connection did not fail")


async def test_missing_client_certificate_under_mutual_tls(
    tls_version: ssl.TLSVersion, caplog: LogCaptureFixture
) -> None:
    """The client learns why: the server's alert (handshake failure, or certificate
    required on TLS 1.3), not an EOF; the listener keeps serving."""
    caplog.set_level(logging.DEBUG, logger="anyio_comm")
    server_ctx = server_context(tls_version, require_client_cert=True)
    async with anyio_comm.listen("tls://127.0.0.1:0", echo, ssl_context=server_ctx) as listener:
        error = await connect_and_receive(listener.address, client_context(tls_version))
        reason = tls_failure_reason(error)
        assert "HANDSHAKE_FAILURE" in reason or "CERTIFICATE_REQUIRED" in reason, reason
        assert f"handshake with {listener.address})" in str(error), str(error)
        await wait_for_debug_log(caplog)
        await assert_round_trip(listener.address, client_context(tls_version, with_cert=True))


async def test_untrusted_client_certificate_alert_reaches_the_client(
    tls_version: ssl.TLSVersion, caplog: LogCaptureFixture
) -> None:
    """A server handshake that fails sends its alert before closing: a client with a
    certificate from another CA sees "unknown CA" (dask, for one, decides from that
    reason not to retry)."""
    caplog.set_level(logging.DEBUG, logger="anyio_comm")
    server_ctx = server_context(tls_version, require_client_cert=True)
    stranger = client_context(tls_version)
    trustme.CA().issue_cert("client@example.org").configure_cert(stranger)
    async with anyio_comm.listen("tls://127.0.0.1:0", echo, ssl_context=server_ctx) as listener:
        error = await connect_and_receive(listener.address, stranger)
        assert "UNKNOWN_CA" in tls_failure_reason(error)
        await wait_for_debug_log(caplog)
        await assert_round_trip(listener.address, client_context(tls_version, with_cert=True))


def debug_messages(caplog: LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "anyio_comm"]


async def test_tls_client_against_plaintext_listener(
    tls_version: ssl.TLSVersion, caplog: LogCaptureFixture
) -> None:
    """The plaintext preamble is not a TLS record: an SSLError whose message names the
    address and says that the peer sent the anyio-comm preamble in plain text; the
    tcp:// listener logs that the client speaks TLS, and keeps serving."""
    caplog.set_level(logging.DEBUG, logger="anyio_comm")
    async with anyio_comm.listen("tcp://127.0.0.1:0", echo) as listener:
        tls_address = listener.address.replace("tcp://", "tls://")
        with anyio.fail_after(10), pytest.raises(ssl.SSLError) as caught:
            await anyio_comm.connect(
                tls_address, ssl_context=client_context(tls_version), timeout=10
            )
        assert type(caught.value) is ssl.SSLError
        assert caught.value.reason == "WRONG_VERSION_NUMBER"
        assert str(caught.value) == (
            f"[SSL: WRONG_VERSION_NUMBER] wrong version number (TLS handshake with "
            f"{tls_address}): the peer does not speak TLS: it sent the anyio-comm "
            "preamble in plain text, as a tcp:// listener does"
        )
        await wait_for_debug_log(caplog)
        (logged,) = debug_messages(caplog)
        assert "the peer sent a TLS record, it speaks TLS: use a tls://" in logged, logged
        async with await anyio_comm.connect(listener.address, timeout=10) as comm:
            await comm.send("plain")
            assert await comm.receive() == "plain"


async def test_plaintext_client_against_tls_listener(
    tls_version: ssl.TLSVersion, caplog: LogCaptureFixture
) -> None:
    """A tcp:// client's preamble is not a ClientHello: the listener answers with a TLS
    alert, so the client's RemoteProtocolError says that the peer speaks TLS (and
    names the address); the listener logs that the client sent a plain preamble."""
    caplog.set_level(logging.DEBUG, logger="anyio_comm")
    server_ctx = server_context(tls_version)
    async with anyio_comm.listen("tls://127.0.0.1:0", echo, ssl_context=server_ctx) as listener:
        tcp_address = listener.address.replace("tls://", "tcp://")
        with anyio.fail_after(10), pytest.raises(RemoteProtocolError) as caught:
            await anyio_comm.connect(tcp_address, timeout=10)
        assert caught.value.rule == "preamble"
        assert str(caught.value) == (
            "peer does not speak the anyio-comm protocol (bad magic: "
            "b'\\x15\\x03\\x01\\x00\\x02\\x02F'): the peer sent a TLS record, it speaks "
            f"TLS: use a tls:// address and an ssl_context (handshake with {tcp_address})"
        )
        await wait_for_debug_log(caplog)
        (logged,) = debug_messages(caplog)
        assert "WRONG_VERSION_NUMBER" in logged, logged
        assert logged.endswith(
            "; the peer does not speak TLS: it sent the anyio-comm preamble in plain "
            "text, as a tcp:// client does"
        ), logged
        await assert_round_trip(listener.address, client_context(tls_version))


async def test_not_tls_hints_need_evidence(tls_version: ssl.TLSVersion) -> None:
    """The hints come from what the peer sent, never from the error alone: a server
    that answers other bytes is said not to speak TLS (and what it sent is shown,
    not called a tcp:// listener); one that closes without a byte gets no hint; a
    plaintext client reading bytes that are not a TLS record gets no TLS hint."""

    async def answer(data: bytes, stream: anyio.abc.SocketStream) -> None:
        """Send ``data`` (if any), then close once the client's first bytes came."""
        async with stream:
            if data:
                await stream.send(data)
            with contextlib.suppress(anyio.EndOfStream, BrokenResourceError):
                await stream.receive()

    ctx = client_context(tls_version)
    for data in (b"HTTP/1.1 400 Bad Request\r\n\r\n", b""):
        async with await anyio.create_tcp_listener(local_host="127.0.0.1") as raw:
            port = raw.extra(SocketAttribute.local_port)
            async with anyio.create_task_group() as tg:
                tg.start_soon(raw.serve, functools.partial(answer, data))
                with anyio.fail_after(10), pytest.raises(ssl.SSLError) as caught:
                    await anyio_comm.connect(f"tls://127.0.0.1:{port}", ssl_context=ctx)
                tg.cancel_scope.cancel()
        message = str(caught.value)
        assert f"(TLS handshake with tls://127.0.0.1:{port})" in message, message
        assert "tcp://" not in message
        if data:
            expected = f": the peer does not speak TLS: it sent {data[:16]!r}"
            assert message.endswith(expected), message
        else:
            assert isinstance(caught.value, ssl.SSLEOFError)
            assert "does not speak TLS" not in message, message

    # plaintext clients: a TLS-looking answer (alert or handshake record, version 3.x)
    # gets the hint, anything else (an application_data record, SSL 2, HTTP) does not
    for data, hint in (
        (b"\x15\x03\x03\x00\x02\x02\x28", True),
        (b"\x16\x03\x01\x00\x05hello", True),
        (b"\x17\x03\x03\x00\x01x", False),
        (b"\x16\x02\x00\x00\x01x", False),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", False),
    ):
        async with await anyio.create_tcp_listener(local_host="127.0.0.1") as raw:
            port = raw.extra(SocketAttribute.local_port)
            async with anyio.create_task_group() as tg:
                tg.start_soon(raw.serve, functools.partial(answer, data))
                with anyio.fail_after(10), pytest.raises(RemoteProtocolError) as caught:
                    await anyio_comm.connect(f"tcp://127.0.0.1:{port}")
                tg.cancel_scope.cancel()
        message = str(caught.value)
        assert message.endswith(f" (handshake with tcp://127.0.0.1:{port})"), message
        assert ("it speaks TLS" in message) is hint, message


async def test_silent_client_is_dropped_after_handshake_timeout(
    tls_version: ssl.TLSVersion, caplog: LogCaptureFixture
) -> None:
    """handshake_timeout covers the TLS handshake: a TCP client that never says hello is cut."""
    caplog.set_level(logging.DEBUG, logger="anyio_comm")
    server_ctx = server_context(tls_version)
    async with anyio_comm.listen(
        "tls://127.0.0.1:0", echo, ssl_context=server_ctx, handshake_timeout=0.2
    ) as listener:
        async with await anyio.connect_tcp("127.0.0.1", port_of(listener.address)) as raw:
            with anyio.fail_after(5), pytest.raises((EndOfStream, BrokenResourceError)):
                while True:  # a TLS server speaks only after the ClientHello: nothing, then EOF
                    await raw.receive()
        await wait_for_debug_log(caplog)
        await assert_round_trip(listener.address, client_context(tls_version))


# --- ragged EOF: TCP closed without close_notify is a broken connection, not a clean end ----
#
# Python before 3.10.11 and 3.11.3 (Debian 12's 3.11.2 among them) sets
# OP_IGNORE_UNEXPECTED_EOF on every context it makes, and OpenSSL then reports a ragged
# EOF as close_notify. Setting the option on purpose gives the same contexts on any
# Python, so every test here runs with the option as the Python set it and with it set.


@pytest.fixture(params=[False, True], ids=["eof-option-default", "ignore-unexpected-eof"])
def eof_option(request: pytest.FixtureRequest) -> Callable[[ssl.SSLContext], ssl.SSLContext]:
    """Give a context ``OP_IGNORE_UNEXPECTED_EOF`` (or leave it as the Python made it)."""
    if request.param and not hasattr(ssl, "OP_IGNORE_UNEXPECTED_EOF"):
        pytest.skip("this ssl module (OpenSSL before 3.0) has no OP_IGNORE_UNEXPECTED_EOF")

    def apply(context: ssl.SSLContext) -> ssl.SSLContext:
        if request.param:
            context.options |= ssl.OP_IGNORE_UNEXPECTED_EOF
        return context

    return apply


def assert_option_kept(context: ssl.SSLContext, before: ssl.Options) -> None:
    """anyio-comm neither clears nor sets a context's options."""
    assert context.options == before


async def test_ragged_eof_from_client_breaks_server_receive(
    tls_version: ssl.TLSVersion, eof_option: Callable[[ssl.SSLContext], ssl.SSLContext]
) -> None:
    """A handler blocked in receive() gets BrokenResourceError, and the listener goes on."""
    client_ctx = client_context(tls_version)
    send, receive = anyio.create_memory_object_stream[BaseException](1)

    async def handler(comm: Comm) -> None:
        """Echo; report how the connection ended (a clean end reports EndOfStream)."""
        outcome: BaseException
        try:
            await echo(comm)
        except Exception as exc:
            outcome = exc
        else:
            outcome = EndOfStream()
        await send.send(outcome)

    server_ctx = eof_option(server_context(tls_version))
    options = server_ctx.options
    async with send, receive:
        async with anyio_comm.listen(
            "tls://127.0.0.1:0", handler, ssl_context=server_ctx
        ) as listener:
            with anyio.fail_after(10):
                tls = await anyio.connect_tcp(
                    "127.0.0.1",
                    port_of(listener.address),
                    ssl_context=client_ctx,
                    tls_standard_compatible=False,
                )
                await tls.send(encode_preamble(Limits()))
                await BufferedByteReceiveStream(tls).receive_exactly(PREAMBLE_SIZE)
                await tls.transport_stream.aclose()  # no close_notify
                outcome = await receive.receive()
            assert isinstance(outcome, BrokenResourceError), repr(outcome)
            await assert_round_trip(listener.address, client_ctx)
    assert_option_kept(server_ctx, options)


@asynccontextmanager
async def cutting_tls_server(
    tls_version: ssl.TLSVersion,
    before_cut: Callable[[TLSStream, BufferedByteReceiveStream], Awaitable[object]] | None = None,
) -> AsyncIterator[int]:
    """A hand-made TLS server on 127.0.0.1 (yields its port) for one client: it sends a
    preamble, reads the client's first 32 bytes, awaits ``before_cut(tls, reader)``, then
    closes TCP without close_notify."""

    async def serve(tcp_listener: anyio.abc.SocketListener) -> None:
        stream = await tcp_listener.accept()
        tls = await TLSStream.wrap(
            stream,
            server_side=True,
            ssl_context=server_context(tls_version),
            standard_compatible=False,
        )
        await tls.send(encode_preamble(Limits()))
        reader = BufferedByteReceiveStream(tls)
        await reader.receive_exactly(PREAMBLE_SIZE)
        if before_cut is not None:
            await before_cut(tls, reader)
        await tls.transport_stream.aclose()  # no close_notify

    multi = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with multi, anyio.create_task_group() as tg:
        (tcp_listener,) = multi.listeners
        tg.start_soon(serve, tcp_listener)
        yield tcp_listener.extra(SocketAttribute.local_port)


async def test_ragged_eof_from_server_breaks_client_receive(
    tls_version: ssl.TLSVersion, eof_option: Callable[[ssl.SSLContext], ssl.SSLContext]
) -> None:
    """The same on the client side, against a hand-made TLS server that drops TCP."""
    client_connected = anyio.Event()
    client_ctx = eof_option(client_context(tls_version))
    options = client_ctx.options
    async with cutting_tls_server(tls_version, lambda *_: client_connected.wait()) as port:
        with anyio.fail_after(10):
            async with await anyio_comm.connect(
                f"tls://127.0.0.1:{port}", ssl_context=client_ctx, timeout=10
            ) as comm:
                client_connected.set()
                with pytest.raises(BrokenResourceError, match="without close_notify"):
                    await comm.receive()
                with pytest.raises(BrokenResourceError):
                    await comm.receive()
    assert_option_kept(client_ctx, options)


async def test_from_stream_over_a_tls_stream_without_the_option_breaks_receive(
    tls_version: ssl.TLSVersion,
) -> None:
    """What the TLS guide tells users of from_stream() with AnyIO's TLSStream: with
    OP_IGNORE_UNEXPECTED_EOF cleared on its context, a cut is BrokenResourceError."""
    client_ctx = client_context(tls_version)
    client_ctx.options &= ~getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)  # as the guide says
    async with cutting_tls_server(tls_version) as port:
        with anyio.fail_after(10):
            stream = await anyio.connect_tcp("127.0.0.1", port, ssl_context=client_ctx)
            async with await anyio_comm.from_stream(stream) as comm:
                with pytest.raises(BrokenResourceError):
                    await comm.receive()


async def test_ragged_eof_inside_a_message_breaks_receive(
    tls_version: ssl.TLSVersion, eof_option: Callable[[ssl.SSLContext], ssl.SSLContext]
) -> None:
    """A TCP close after part of a message's records (the rest never comes) is broken too."""

    async def part_of_a_message(tls: TLSStream, _: object) -> None:
        # a message of one 1000-byte frame, of which only the length table and 10 bytes
        # arrive, in whole records
        await tls.send(encode_header([1000]) + b"x" * 10)

    client_ctx = eof_option(client_context(tls_version))
    async with cutting_tls_server(tls_version, part_of_a_message) as port:
        with anyio.fail_after(10):
            async with await anyio_comm.connect(
                f"tls://127.0.0.1:{port}", ssl_context=client_ctx, timeout=10
            ) as comm:
                with pytest.raises(BrokenResourceError):
                    await comm.receive_frames()


@asynccontextmanager
async def bio_tls_client(
    tls_version: ssl.TLSVersion,
    then: Callable[[ssl.SSLObject, ssl.MemoryBIO, anyio.abc.SocketStream], Awaitable[object]],
    **options: Any,
) -> AsyncIterator[Comm]:
    """A comm connected (within 5 s, with ``options``) to a TLS server over an
    ``SSLObject`` and memory BIOs on 127.0.0.1: the handshake, a preamble each way, then
    ``then(sslobj, outgoing, tcp_stream)``, which writes what ciphertext it likes; then
    TCP closes."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    sslobj = server_context(tls_version).wrap_bio(incoming, outgoing, server_side=True)

    async def serve(tcp_listener: anyio.abc.SocketListener) -> None:
        async with await tcp_listener.accept() as stream:
            while True:
                try:
                    sslobj.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    if outgoing.pending:
                        await stream.send(outgoing.read())
                    incoming.write(await stream.receive())
            sslobj.write(encode_preamble(Limits()))
            await stream.send(outgoing.read())
            received = b""
            while len(received) < PREAMBLE_SIZE:
                try:
                    received += sslobj.read(PREAMBLE_SIZE)
                except ssl.SSLWantReadError:
                    incoming.write(await stream.receive())
            await then(sslobj, outgoing, stream)

    multi = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with multi, anyio.create_task_group() as tg:
        (tcp_listener,) = multi.listeners
        tg.start_soon(serve, tcp_listener)
        port = tcp_listener.extra(SocketAttribute.local_port)
        with anyio.fail_after(5):
            comm = await anyio_comm.connect(
                f"tls://127.0.0.1:{port}",
                ssl_context=client_context(tls_version),
                timeout=5,
                **options,
            )
        async with comm:
            yield comm
        tg.cancel_scope.cancel()


async def test_a_bad_record_behind_a_message_breaks_the_next_receive(
    tls_version: ssl.TLSVersion,
) -> None:
    """A message's record and a forged one behind it, in one TCP segment: the message
    is received, and the next receive raises BrokenResourceError (OpenSSL took the
    forged record while the message was read: the error is not lost with it)."""

    async def message_then_forged_record(
        sslobj: ssl.SSLObject, outgoing: ssl.MemoryBIO, stream: anyio.abc.SocketStream
    ) -> None:
        sslobj.write(encode_header([5]) + b"hello")
        message = outgoing.read()
        sslobj.write(b"forged")
        forged = bytearray(outgoing.read())
        forged[-1] ^= 1  # (the record's authentication tag no longer matches)
        await stream.send(message + bytes(forged))
        await anyio.sleep(10)  # (keeps TCP open: only the record can end it)

    async with bio_tls_client(tls_version, message_then_forged_record) as comm:
        with anyio.fail_after(5):
            assert [bytes(f) for f in await comm.receive_frames()] == [b"hello"]
            with pytest.raises(BrokenResourceError, match="TLS error"):
                await comm.receive_frames()


#: frame sizes of the messages below (-1: a message of many short frames and a large one,
#: which the push engine leaves to the task)
CUT_SIZES = [0, 1, 5, 100, 1000, 4000, 5000, 16_000, 16_400, 70_000, 300_000, -1]
MANY_FRAMES = [10] * 40 + [20_000] + [3] * 5


@pytest.mark.parametrize("engine", ["auto", "pull"])
@pytest.mark.parametrize("seed", range(4))
async def test_messages_whose_ciphertext_is_cut_anywhere_then_close_notify(
    tls_version: ssl.TLSVersion, engine: str, seed: int
) -> None:
    """Messages of every size, their ciphertext cut at random (inside records and at
    their ends) and sent piece by piece with pauses, then close_notify with TCP kept
    open: both receive engines, with a small read buffer (large frames are the task's),
    take every message and then the clean end, never waiting on a socket while
    OpenSSL holds what they need."""
    rng = random.Random(seed)
    sizes = [rng.choice(CUT_SIZES) for _ in range(rng.randint(3, 10))]

    def frames_of(size: int) -> list[int]:
        return MANY_FRAMES if size < 0 else [size]

    async def cut_messages(
        sslobj: ssl.SSLObject, outgoing: ssl.MemoryBIO, stream: anyio.abc.SocketStream
    ) -> None:
        for i, size in enumerate(sizes):
            lengths = frames_of(size)
            sslobj.write(encode_header(lengths) + bytes([i]) * sum(lengths))
        with contextlib.suppress(ssl.SSLError):
            sslobj.unwrap()
        ciphertext = outgoing.read()
        start = 0
        while start < len(ciphertext):
            end = start + rng.choice([1, 5, 6, 100, 4096, 5000, 17_000, 70_000])
            await stream.send(ciphertext[start:end])
            start = end
            await anyio.sleep(rng.choice([0, 0, 0.001, 0.003]))
        await anyio.sleep(30)  # TCP stays open: only close_notify ends the stream

    async with bio_tls_client(
        tls_version, cut_messages, receive_engine=engine, read_buffer_size=4096
    ) as comm:
        with anyio.fail_after(10):
            for i, size in enumerate(sizes):
                frames = await comm.receive_frames()
                assert [len(f) for f in frames] == frames_of(size)
                assert all(bytes(f) == bytes([i]) * len(f) for f in frames)
            with pytest.raises(EndOfStream):
                await comm.receive_frames()


@pytest.mark.parametrize("size", [5, 100_000])
@pytest.mark.parametrize("peer", ["closes TCP", "keeps TCP open"])
async def test_close_notify_behind_a_message_is_a_clean_end_after_send_eof(
    tls_version: ssl.TLSVersion, size: int, peer: str
) -> None:
    """The peer sends a message and close_notify in one segment; we receive the
    message, then send_eof() (whose shutdown may read the peer's close_notify first),
    then receive: a clean end, whether the peer then closes TCP or not."""

    async def message_and_close_notify(
        sslobj: ssl.SSLObject, outgoing: ssl.MemoryBIO, stream: anyio.abc.SocketStream
    ) -> None:
        sslobj.write(encode_header([size]) + b"h" * size)
        with contextlib.suppress(ssl.SSLError):
            sslobj.unwrap()  # (writes close_notify first, whatever it says then)
        await stream.send(outgoing.read())
        with anyio.move_on_after(5):
            await stream.receive()  # the client's close_notify
        if peer == "keeps TCP open":
            await anyio.sleep(10)

    async with bio_tls_client(tls_version, message_and_close_notify) as comm:
        with anyio.fail_after(5):
            assert [len(f) for f in await comm.receive_frames()] == [size]
            await comm.send_eof()
            with pytest.raises(EndOfStream):
                await comm.receive_frames()


@pytest.mark.parametrize("size", [5, 100_000])
async def test_send_eof_keeps_the_peers_data_already_received(
    tls_version: ssl.TLSVersion, size: int
) -> None:
    """Two messages arrive in one segment; we receive the first, send_eof() (the TLS
    shutdown, which looks for the peer's close_notify), then receive the second: data
    that arrived before our close_notify is still read after it (TLS half-close)."""

    async def two_messages(
        sslobj: ssl.SSLObject, outgoing: ssl.MemoryBIO, stream: anyio.abc.SocketStream
    ) -> None:
        sslobj.write(encode_header([size]) + b"a" * size)
        sslobj.write(encode_header([5]) + b"later")
        await stream.send(outgoing.read())
        with anyio.move_on_after(5):
            await stream.receive()  # the client's close_notify
        with contextlib.suppress(ssl.SSLError):
            sslobj.unwrap()
        await stream.send(outgoing.read())
        await anyio.sleep(10)

    async with bio_tls_client(tls_version, two_messages) as comm:
        with anyio.fail_after(5):
            assert [len(f) for f in await comm.receive_frames()] == [size]
            await comm.send_eof()
            assert [bytes(f) for f in await comm.receive_frames()] == [b"later"]
            with pytest.raises(EndOfStream):
                await comm.receive_frames()


@pytest.mark.parametrize("closer", ["client", "server"])
async def test_close_notify_is_a_clean_end_whatever_the_eof_option(
    tls_version: ssl.TLSVersion,
    eof_option: Callable[[ssl.SSLContext], ssl.SSLContext],
    closer: str,
) -> None:
    """With close_notify (aclose), the other side's receive ends cleanly: EndOfStream
    after every message sent before it, on contexts with or without the option."""
    server_ctx = eof_option(server_context(tls_version))
    client_ctx = eof_option(client_context(tls_version))
    async with tls_pair(server_ctx, client_ctx) as (client, server):
        closing, reading = (client, server) if closer == "client" else (server, client)
        with anyio.fail_after(10):
            await closing.send({"last": 1})
            await closing.aclose()
            assert await reading.receive() == {"last": 1}
            with pytest.raises(EndOfStream):
                await reading.receive()


async def test_half_close_is_a_clean_end_whatever_the_eof_option(
    tls_version: ssl.TLSVersion, eof_option: Callable[[ssl.SSLContext], ssl.SSLContext]
) -> None:
    """send_eof() sends close_notify: the peer reads a clean end and can still reply;
    the reply's close_notify then ends the first side's receive cleanly too."""
    server_ctx = eof_option(server_context(tls_version))
    client_ctx = eof_option(client_context(tls_version))
    async with tls_pair(server_ctx, client_ctx) as (client, server):
        with anyio.fail_after(10):
            await client.send("question")
            await client.send_eof()
            assert await server.receive() == "question"
            with pytest.raises(EndOfStream):
                await server.receive()
            await server.send("answer")
            await server.aclose()
            assert await client.receive() == "answer"
            with pytest.raises(EndOfStream):
                await client.receive()


async def test_tcp_close_during_the_handshake_is_an_eof_error(
    tls_version: ssl.TLSVersion, eof_option: Callable[[ssl.SSLContext], ssl.SSLContext]
) -> None:
    """A server that closes TCP after reading the ClientHello fails connect() with
    ssl.SSLEOFError on every context, never with a clean-close error."""

    async def read_then_close(tcp_listener: anyio.abc.SocketListener) -> None:
        async with await tcp_listener.accept() as stream:
            await stream.receive()  # the ClientHello

    multi = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with multi, anyio.create_task_group() as tg:
        (tcp_listener,) = multi.listeners
        tg.start_soon(read_then_close, tcp_listener)
        port = tcp_listener.extra(SocketAttribute.local_port)
        with anyio.fail_after(10), pytest.raises(ssl.SSLEOFError) as info:
            await anyio_comm.connect(
                f"tls://127.0.0.1:{port}",
                ssl_context=eof_option(client_context(tls_version)),
                timeout=10,
            )
    # the error OpenSSL gives without the option, fields and message alike
    assert (info.value.reason, info.value.library) == ("UNEXPECTED_EOF_WHILE_READING", "SSL")
    assert str(info.value).startswith(
        "[SSL: UNEXPECTED_EOF_WHILE_READING] EOF occurred in violation of protocol "
        f"(TLS handshake with tls://127.0.0.1:{port})"
    )


async def test_ragged_eof_after_our_send_eof_breaks_receive(
    tls_version: ssl.TLSVersion, eof_option: Callable[[ssl.SSLContext], ssl.SSLContext]
) -> None:
    """After send_eof() (our close_notify is out), a peer that drops TCP without its
    own close_notify still breaks the receive: the half-closed session is no excuse."""

    async def until_close_notify(_: object, reader: BufferedByteReceiveStream) -> None:
        with pytest.raises(EndOfStream):  # the rest of the preamble, then close_notify
            while True:
                await reader.receive()

    client_ctx = eof_option(client_context(tls_version))
    async with cutting_tls_server(tls_version, until_close_notify) as port:
        with anyio.fail_after(10):
            async with await anyio_comm.connect(
                f"tls://127.0.0.1:{port}", ssl_context=client_ctx, timeout=10
            ) as comm:
                await comm.send_eof()
                with pytest.raises(BrokenResourceError, match="without close_notify"):
                    await comm.receive()


async def test_client_handshake_timeout(tls_version: ssl.TLSVersion) -> None:
    """connect(timeout=) covers the TLS handshake: a server that never answers times out."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as silent:
        port = silent.extra(SocketAttribute.local_port)
        with anyio.fail_after(5), pytest.raises(TimeoutError):
            await anyio_comm.connect(
                f"tls://127.0.0.1:{port}", ssl_context=client_context(tls_version), timeout=0.2
            )


async def test_retry_does_not_retry_a_rejected_certificate(tls_version: ssl.TLSVersion) -> None:
    """connect(retry=True) retries a listener that is not there yet, not one that
    rejects the client's certificate: the TLS error comes at once (under TLS 1.3 as
    the cause of a BrokenResourceError, the server's alert coming after the
    client's handshake completed)."""
    server_ctx = server_context(tls_version, require_client_cert=True)
    stranger = client_context(tls_version)
    trustme.CA().issue_cert("client@example.org").configure_cert(stranger)
    async with anyio_comm.listen("tls://127.0.0.1:0", echo, ssl_context=server_ctx) as listener:
        with anyio.fail_after(5):  # far inside connect's own timeout: no retries
            try:
                async with await anyio_comm.connect(
                    listener.address, ssl_context=stranger, retry=True, timeout=60
                ) as comm:
                    await comm.receive()
            except (ssl.SSLError, BrokenResourceError) as exc:
                error: BaseException = exc
            else:
                raise AssertionError("the connection did not fail")
        assert "UNKNOWN_CA" in tls_failure_reason(error)


# --- clients that stall in the handshake ---------------------------------------------------


def client_hello(tls_version: ssl.TLSVersion) -> bytes:
    """A ClientHello as anyio-comm's own client sends it."""
    outgoing = ssl.MemoryBIO()
    sslobj = client_context(tls_version).wrap_bio(
        ssl.MemoryBIO(), outgoing, server_hostname="localhost"
    )
    with contextlib.suppress(ssl.SSLWantReadError):
        sslobj.do_handshake()
    return outgoing.read()


async def test_a_stalled_handshake_holds_no_read_ahead_buffer(
    tls_version: ssl.TLSVersion,
) -> None:
    """A client that stalls in its TLS handshake costs the server its TLS state only: the
    comm's read-ahead buffer (64 KiB) is allocated once the handshake is complete."""
    hello = client_hello(tls_version)
    count = 20
    async with (
        anyio_comm.listen(
            "tls://127.0.0.1:0", echo, ssl_context=server_context(tls_version)
        ) as listener,
        contextlib.AsyncExitStack() as stack,
    ):
        port = port_of(listener.address)

        async def stall() -> None:
            stream = await stack.enter_async_context(await anyio.connect_tcp("127.0.0.1", port))
            await stream.send(hello)
            with anyio.fail_after(10):
                assert await stream.receive()  # the server waits for our Finished now

        await stall()  # (whatever a first connection allocates once)
        gc.collect()
        tracemalloc.start()
        try:
            for _ in range(count):
                await stall()
            gc.collect()
            snapshot = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
    # (the largest block a stalled handshake holds is its 33 KiB buffer for TLS records)
    large = [trace for trace in snapshot.traces if trace.size >= DEFAULT_READ_BUFFER_SIZE]
    assert len(large) < count // 4, [trace.traceback.format()[-1] for trace in large[:3]]


# --- handshake storms: handshake_threads ---------------------------------------------------
#
# The server's handshake steps are made slow (or held) by a probe: an SSLObject class whose
# do_handshake() sleeps (or waits for an event) in every call after the first one, i.e. in
# every call that has what the client sent to process, wherever it runs (the event loop's
# thread or a worker's), and counts how many such calls run at once.


class HandshakeProbe:
    """Slows down (``delay`` seconds) or holds (until :meth:`release`) the server's
    handshake steps that process client data; counts them."""

    def __init__(self, delay: float = 0.0, *, hold: bool = False) -> None:
        self.delay = delay
        self.hold = hold
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.running = 0  # steps in do_handshake() now
        self.most = 0  # the most at once
        self.steps = 0  # steps begun

    def release(self) -> None:
        """Let held steps (and every later one) go on."""
        self._released.set()

    def context(self, tls_version: ssl.TLSVersion) -> ssl.SSLContext:
        """A server context whose handshakes this probe slows down."""
        probe = self

        class ProbedSSLObject(ssl.SSLObject):
            calls = 0

            def do_handshake(self) -> None:
                self.calls += 1
                if self.calls == 1:  # nothing received yet: OpenSSL asks for the ClientHello
                    super().do_handshake()
                    return
                with probe._lock:
                    probe.running += 1
                    probe.steps += 1
                    probe.most = max(probe.most, probe.running)
                try:
                    if probe.hold:
                        probe._released.wait(10)
                    time.sleep(probe.delay)  # the CPU an expensive step would take
                    super().do_handshake()
                finally:
                    with probe._lock:
                        probe.running -= 1

        context = server_context(tls_version)
        context.sslobject_class = ProbedSSLObject
        return context


def handshake_turns(listener: anyio_comm.Listener) -> anyio.CapacityLimiterStatistics:
    limiter = listener._server.handshake_limiter
    assert limiter is not None
    return limiter.statistics()


async def test_handshake_threads_is_checked() -> None:
    """handshake_threads is a positive int (for listen and serve alike); tls:// listeners
    report it, others have none."""
    ctx = server_context()
    for bad, error in [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="handshake_threads must be"):
            async with anyio_comm.listen(
                "tls://127.0.0.1:0",
                echo,
                ssl_context=ctx,
                handshake_threads=bad,  # type: ignore[arg-type]
            ):
                pass
    with pytest.raises(ValueError, match="handshake_threads must be"):
        await anyio_comm.serve("tls://127.0.0.1:0", echo, ssl_context=ctx, handshake_threads=0)
    async with anyio_comm.listen("tls://127.0.0.1:0", echo, ssl_context=ctx) as listener:
        assert listener.handshake_threads == 1
    async with anyio_comm.listen(
        "tls://127.0.0.1:0", echo, ssl_context=ctx, handshake_threads=5
    ) as listener:
        assert listener.handshake_threads == 5
    async with anyio_comm.listen("tcp://127.0.0.1:0", echo, handshake_threads=5) as listener:
        assert listener.handshake_threads is None


@pytest.mark.parametrize("threads", [1, 2])
async def test_handshakes_beyond_handshake_threads_wait_then_complete(
    tls_version: ssl.TLSVersion, threads: int
) -> None:
    """Five clients at once: no more than ``threads`` handshake steps run at a time (and
    that many do), and every client gets its connection."""
    probe = HandshakeProbe(0.1)
    async with anyio_comm.listen(
        "tls://127.0.0.1:0",
        echo,
        ssl_context=probe.context(tls_version),
        handshake_threads=threads,
    ) as listener:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(assert_round_trip, listener.address, client_context(tls_version))
        assert probe.steps >= 10  # the ClientHello and Finished of each client
        assert probe.most == threads
        assert handshake_turns(listener).borrowed_tokens == 0


async def test_established_connections_keep_their_latency_during_slow_handshakes(
    tls_version: ssl.TLSVersion,
) -> None:
    """While clients' handshakes take 0.2 s per step, a client on an established connection
    gets every reply well within one such step: the steps do not stop the event loop."""
    probe = HandshakeProbe()
    client_ctx = client_context(tls_version)
    async with anyio_comm.listen(
        "tls://127.0.0.1:0", echo, ssl_context=probe.context(tls_version)
    ) as listener:
        async with await anyio_comm.connect(
            listener.address, ssl_context=client_ctx, timeout=10
        ) as comm:
            probe.delay = 0.2
            slowest = 0.0
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    for _ in range(3):
                        tg.start_soon(assert_round_trip, listener.address, client_ctx)
                    while probe.steps < 6 or probe.running:  # (6: each client's two steps)
                        start = anyio.current_time()
                        await comm.send(b"ping")
                        assert await comm.receive() == b"ping"
                        slowest = max(slowest, anyio.current_time() - start)
                        await anyio.sleep(0.01)
    assert slowest < 0.15


async def test_stalled_handshakes_do_not_lock_out_new_ones(tls_version: ssl.TLSVersion) -> None:
    """Clients that stall after their ClientHello (or say nothing) hold no turn: with one
    handshake thread and eight such clients, a new client connects at once."""
    hello = client_hello(tls_version)
    async with (
        anyio_comm.listen(
            "tls://127.0.0.1:0",
            echo,
            ssl_context=server_context(tls_version),
            handshake_threads=1,
            handshake_timeout=60,
        ) as listener,
        contextlib.AsyncExitStack() as stack,
    ):
        port = port_of(listener.address)
        for _ in range(4):  # silent
            await stack.enter_async_context(await anyio.connect_tcp("127.0.0.1", port))
        for _ in range(8):  # stalled in the handshake, after the server's answer
            stalled = await stack.enter_async_context(await anyio.connect_tcp("127.0.0.1", port))
            await stalled.send(hello)
            with anyio.fail_after(10):
                assert await stalled.receive()  # the server's flight: it waits for us now
        with anyio.fail_after(5):  # far within handshake_timeout
            await assert_round_trip(listener.address, client_context(tls_version))


async def wait_until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.01)


async def assert_dropped(stream: anyio.abc.ByteStream) -> None:
    """The server closes ``stream`` without a byte."""
    with anyio.fail_after(10), pytest.raises((EndOfStream, BrokenResourceError)):
        await stream.receive()


async def test_new_connections_and_handshakes_wait_for_a_turn(
    tls_version: ssl.TLSVersion,
) -> None:
    """With the only turn held by a step that does not finish, a connected client's
    handshake step waits for it, and a new connection is not even accepted (it waits in
    the backlog); once the step finishes, both are served in turn."""
    probe = HandshakeProbe(hold=True)
    client_ctx = client_context(tls_version)
    hello = client_hello(tls_version)
    async with anyio_comm.listen(
        "tls://127.0.0.1:0",
        echo,
        ssl_context=probe.context(tls_version),
        handshake_threads=1,
    ) as listener:
        port = port_of(listener.address)
        connections = listener._server.connections
        async with await anyio.connect_tcp("127.0.0.1", port) as accepted:
            await wait_until(lambda: len(connections) == 1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(assert_round_trip, listener.address, client_ctx)
                await wait_until(lambda: probe.running == 1)
                await accepted.send(hello)
                await wait_until(lambda: handshake_turns(listener).tasks_waiting == 1)
                async with await anyio.connect_tcp("127.0.0.1", port) as backlogged:
                    await backlogged.send(hello)
                    await wait_until(lambda: handshake_turns(listener).tasks_waiting == 2)
                    await anyio.sleep(0.2)
                    assert len(connections) == 2  # the one in the backlog is not accepted
                    assert probe.steps == 1
                    probe.release()
                    with anyio.fail_after(10):  # both get the server's flight
                        assert await accepted.receive()
                        assert await backlogged.receive()
        await wait_until(lambda: handshake_turns(listener).borrowed_tokens == 0)
        assert probe.steps >= 4  # the first client's two steps, one for each other (and EOFs)


async def test_handshake_timeout_cancels_a_handshake_waiting_for_its_turn(
    tls_version: ssl.TLSVersion,
) -> None:
    """A handshake step waiting for the turn a held step has is dropped at
    handshake_timeout, leaving no turn taken or awaited; the held step then completes
    and its client (connected half a second later, so within its own handshake_timeout
    still) is served."""
    probe = HandshakeProbe(hold=True)
    client_ctx = client_context(tls_version)
    async with anyio_comm.listen(
        "tls://127.0.0.1:0",
        echo,
        ssl_context=probe.context(tls_version),
        handshake_threads=1,
        handshake_timeout=1,
    ) as listener:
        connections = listener._server.connections
        async with await anyio.connect_tcp("127.0.0.1", port_of(listener.address)) as late:
            await wait_until(lambda: len(connections) == 1)
            await anyio.sleep(0.5)
            async with anyio.create_task_group() as tg:
                tg.start_soon(assert_round_trip, listener.address, client_ctx)
                await wait_until(lambda: probe.running == 1)
                await late.send(client_hello(tls_version))
                await wait_until(lambda: handshake_turns(listener).tasks_waiting == 1)
                await assert_dropped(late)
                stats = handshake_turns(listener)
                assert (stats.borrowed_tokens, stats.tasks_waiting) == (1, 0)
                assert probe.steps == 1  # the late client's step never ran
                probe.release()
        stats = handshake_turns(listener)
        assert (stats.borrowed_tokens, stats.tasks_waiting) == (0, 0)
        assert probe.steps == 2


async def test_leaving_listen_during_waiting_handshakes_leaves_nothing_behind(
    tls_version: ssl.TLSVersion,
) -> None:
    """Leaving ``listen`` while a handshake step runs (held), another client's waits for
    its turn and a third client waits in the backlog: the waiting step is cancelled at
    once, the running one completes first, and then every connection is closed, no turn
    is taken or awaited."""
    probe = HandshakeProbe(hold=True)
    client_ctx = client_context(tls_version)
    hello = client_hello(tls_version)
    failed: list[BaseException] = []

    async def held_client(address: str) -> None:
        try:
            await assert_round_trip(address, client_ctx)
        except (OSError, BrokenResourceError, EndOfStream) as exc:
            failed.append(exc)

    with anyio.fail_after(20):
        async with (
            anyio.create_task_group() as tg,
            contextlib.AsyncExitStack() as stack,
        ):
            async with anyio_comm.listen(
                "tls://127.0.0.1:0",
                echo,
                ssl_context=probe.context(tls_version),
                handshake_threads=1,
            ) as listener:
                port = port_of(listener.address)
                connections = listener._server.connections
                waiting = await stack.enter_async_context(
                    await anyio.connect_tcp("127.0.0.1", port)
                )
                await wait_until(lambda: len(connections) == 1)
                tg.start_soon(held_client, listener.address)
                await wait_until(lambda: probe.running == 1)
                await waiting.send(hello)
                backlogged = await stack.enter_async_context(
                    await anyio.connect_tcp("127.0.0.1", port)
                )
                await backlogged.send(hello)
                await wait_until(lambda: handshake_turns(listener).tasks_waiting == 2)
                tg.start_soon(_release_later, probe, 0.2)  # the held step, once we leave
            stats = handshake_turns(listener)
            assert (stats.borrowed_tokens, stats.tasks_waiting) == (0, 0)
            assert probe.running == 0
            assert probe.steps == 1  # the waiting client's step never ran
            assert connections == set()
            await assert_dropped(waiting)
            await assert_dropped(backlogged)
    assert len(failed) == 1  # the held client's connection failed too


async def _release_later(probe: HandshakeProbe, delay: float) -> None:
    await anyio.sleep(delay)
    probe.release()
