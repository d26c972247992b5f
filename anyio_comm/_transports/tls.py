"""TLS over any transport with ``ssl.SSLObject`` and two ``MemoryBIO`` buffers.

Theory of operation
-------------------
``ssl.SSLObject`` is OpenSSL without I/O: ciphertext goes in through the
*incoming* BIO and comes out of the *outgoing* BIO; we move it with the inner
transport (normally the raw socket transport). Compared with asyncio's SSL
protocol or a non-blocking ``SSLSocket``, this keeps our own receive path:

* receive: ``SSLObject.read(n, buffer)`` decrypts straight into the buffer the
  decoder hands out, which for a large frame is the frame's own buffer. Only
  when OpenSSL needs more ciphertext do we receive into one reused buffer,
  which starts at 4 KiB and grows fourfold whenever a read fills it, up to
  256 KiB, and feed it to the incoming BIO. Like every transport, the
  receive never waits (:meth:`TLSTransport.receive_into_nowait` returns
  ``None`` when neither OpenSSL nor the socket has anything); waiting is the
  inner transport's :meth:`~TLSTransport.wait_readable`. When OpenSSL holds
  nothing to work on (no ciphertext in the BIO, no plaintext left of a record)
  the receive goes to the socket first, without a ``read()`` that would only
  raise ``SSLWantReadError``: an exception less per message.
* send: the plaintext buffers are encrypted in slices of at most 64 KiB and
  the ciphertext is flushed to the inner transport whenever 64 KiB of it has
  built up, and at the end of the message: a small message is one write, and
  a 10 MB message is never held twice in memory (see :data:`SEND_CHUNK` for
  why not larger slices). A small send queued behind
  (:meth:`TLSTransport.send_later`) is kept as plaintext, with room reserved
  for its ciphertext on the inner transport's queue, and the whole batch is
  encrypted in one call when that queue is written (one record per 16 KiB,
  not per message); a send that writes encrypts it first.
* end of stream: the peer's ``close_notify`` is a clean EOF; a TCP close
  without it (ragged EOF) is :exc:`anyio.BrokenResourceError`, so a
  truncation by an attacker is never mistaken for the end of the stream.
  That does not rest on the context's options: Python before 3.10.11 and
  3.11.3 sets ``ssl.OP_IGNORE_UNEXPECTED_EOF`` on every context it makes
  (so does any user who asks for it), and OpenSSL then reports a ragged EOF
  exactly as it reports ``close_notify``. The incoming BIO tells the two
  apart: the end of the TCP stream is fed to it only once OpenSSL has read
  every byte it was given, and after a ``read()`` that returned bytes before
  the session ended (or after ``send_eof()``'s ``unwrap()`` took the peer's
  ``close_notify``), only after OpenSSL was asked again, so every complete
  record before that end, a ``close_notify`` included, has been read by then.
  A TLS error met after a ``read()`` received bytes is kept and raised by the
  next one (OpenSSL would report an end of file then). An end of the session
  that OpenSSL reports once the BIO is at its end, with no ``close_notify``
  read before, is a ragged EOF. The context is neither changed nor refused.
  ``send_eof()`` sends ``close_notify`` and keeps reading (TLS half-close).
  ``aclose()`` sends ``close_notify`` if it can within 0.1 s, then closes;
  while another task is in the middle of a send it closes abruptly instead.

A server makes its ``SSLObject`` and its ciphertext buffer only when the
client's first bytes can be read: until then a client that connected and sent
nothing costs the server neither (``wrap_bio`` takes about 10 KiB of OpenSSL's
memory, and its first ``do_handshake`` sets up buffers of about 33 KiB more).

Handshake: ``do_handshake()`` runs until OpenSSL asks for ciphertext, which we
then receive (waiting if need be). With a ``handshake_limiter`` (a listener's),
every call that has received ciphertext to work on (the ClientHello's key
exchange and signature, the check of the client's Finished: the steps that cost
CPU) runs in a worker thread holding one of the limiter's tokens, so that a storm
of handshakes neither stops the event loop nor takes more than that many
threads' worth of CPU; waiting for the peer holds no token, so a peer that stalls
in its handshake blocks no one. The thread returns OpenSSL's errors rather than
raising them, and without their traceback: an exception that passed through the
worker's future, or a traceback through the worker's frames, would keep the
transport in a reference cycle (freed only by the garbage collector, which a
storm of handshakes then keeps busy).

Reading and sending may run in two tasks at once (the comm guards each
direction): each touches only its own BIO, and ``SSLObject`` calls never
await. Records OpenSSL produces while reading (a TLS 1.3 KeyUpdate reply) wait
in the outgoing BIO for the next send.

Errors: a failed handshake raises the ``ssl.SSLError`` itself (for an
untrusted or expired certificate or a hostname mismatch,
``ssl.SSLCertVerificationError``), after sending the alert OpenSSL wrote, so
that the peer learns the reason too; a TLS error after the handshake (an
alert from the peer, a bad record) is :exc:`anyio.BrokenResourceError` caused
by the ``ssl.SSLError``. OpenSSL writes no alert when the client's first bytes
are not a TLS record at all (a client that does not speak TLS): a server
answers those with a ``protocol_version`` alert of its own (:data:`NOT_TLS_ALERT`),
so that such a client sees that the server speaks TLS rather than a bare end of
file. The peer's first bytes stay readable (:attr:`TLSTransport.peer_first_bytes`)
for the error messages of the layers above.
"""

from __future__ import annotations

import contextlib
import ssl
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread
from anyio import BrokenResourceError, CancelScope, CapacityLimiter, ClosedResourceError
from anyio.streams.tls import TLSAttribute

from .base import Transport

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from .._sansio._buffer import Buffer

__all__ = ["TLSTransport", "looks_like_tls_record"]

#: ciphertext received per system call at most
CHUNK: Final = 256 * 1024
#: plaintext encrypted per flush at most: each flush reads the ciphertext out of the
#: outgoing BIO into a new bytes object, which must stay below malloc's mapping
#: threshold (128 KiB unless it adapts, and it does not in processes that set
#: MALLOC_TRIM_THRESHOLD_, as dask's workers do), or every flush maps, faults in and
#: unmaps its memory: 32 MB messages ran at half the speed there with 256 KiB
SEND_CHUNK: Final = 64 * 1024
#: the ciphertext receive buffer's first size: a ClientHello fits, and it grows
#: fourfold whenever a read fills it (4, 16, 64, then 256 KiB), so that an idle
#: connection costs little
FIRST_CIPHER_BUFFER: Final = 4 * 1024
#: the largest plaintext of a TLS record, and a bound (with margin) on what a
#: record adds to it (header, explicit IV, MAC or tag, padding: at most 85 bytes
#: with TLS 1.2's CBC-SHA384 suites): they bound the ciphertext of a send queued
#: behind
MAX_RECORD: Final = 16 * 1024
RECORD_OVERHEAD: Final = 256
CLOSE_NOTIFY_TIMEOUT: Final = 0.1
#: the message of a TCP close without close_notify
RAGGED_EOF: Final = "TLS connection closed without close_notify"
#: the ciphertext buffer of a server before the client's first bytes: none
_NO_CIPHER: Final = memoryview(b"")
#: how many of the peer's first bytes a transport keeps (for error messages)
FIRST_BYTES_KEPT: Final = 16
#: what a server answers to a client whose first bytes are not a TLS record: an alert
#: record (type 21, version 3.1 as before version negotiation, 2 bytes), fatal (2),
#: protocol_version (70)
NOT_TLS_ALERT: Final = b"\x15\x03\x01\x00\x02\x02\x46"


def looks_like_tls_record(data: bytes) -> bool:
    """Whether ``data`` (at least its first byte) may begin a TLS record: a content
    type of 20 to 24 (change_cipher_spec, alert, handshake, application_data,
    heartbeat), then major version 3."""
    return bool(data) and 20 <= data[0] <= 24 and (len(data) < 2 or data[1] == 3)


def _unexpected_eof() -> ssl.SSLEOFError:
    """The error OpenSSL gives for a TCP close in the handshake without
    ``OP_IGNORE_UNEXPECTED_EOF``: its message, ``reason`` and ``library``."""
    error = ssl.SSLEOFError(
        ssl.SSL_ERROR_EOF,
        "[SSL: UNEXPECTED_EOF_WHILE_READING] EOF occurred in violation of protocol",
    )
    error.reason = "UNEXPECTED_EOF_WHILE_READING"
    error.library = "SSL"
    return error


class TLSTransport(Transport):
    """A TLS connection over ``inner``, which this transport owns.

    ``handshake_limiter``: run the handshake's steps that work on received ciphertext
    in worker threads, each holding one of its tokens (see the module docstring).
    """

    __slots__ = (
        "_cipher",
        "_cipher_ended",
        "_closed",
        "_context",
        "_eof",
        "_handshake_limiter",
        "_incoming",
        "_inner",
        "_outgoing",
        "_peer_first_bytes",
        "_pending_counted",
        "_plain",
        "_read_again",
        "_sealed",
        "_send_interrupted",
        "_sending",
        "_ssl",
        "_tls_error",
        "_unsent",
        "drained",
    )

    def __init__(
        self,
        inner: Transport,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        handshake_limiter: CapacityLimiter | None = None,
    ) -> None:
        self._inner = inner
        self.drained = False
        self._handshake_limiter = handshake_limiter
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._context = context
        # A client's session and ciphertext buffer now (its handshake begins by
        # writing); a server's once the client's first bytes can be read (see
        # _start_session): a client that sends nothing costs neither.
        self._ssl: ssl.SSLObject | None = None
        self._cipher = _NO_CIPHER
        self._cipher_ended = False  # the end of the TCP stream was fed to OpenSSL
        if not server_side:
            self._start_session(server_side=False, server_hostname=server_hostname)
        self._closed = False
        self._sending = False
        self._send_interrupted = False
        # send_eof() has shut the TLS session down for sending; ``_unsent`` is
        # the close_notify ciphertext a cancelled send_eof() did not write yet
        self._eof = False
        self._unsent = b""
        self._peer_first_bytes = b""
        # a read returned bytes before OpenSSL ended the session or failed: the
        # next one must ask OpenSSL first (see receive_into_nowait)
        self._read_again = False
        # the TLS error a read met after it had received bytes: for the next one
        self._tls_error: ssl.SSLError | None = None
        # plaintext of small sends queued behind (see send_later); the outgoing
        # BIO's bytes counted in the room reserved for it; its ciphertext once a
        # send encrypted it first, for the inner transport's queue to take
        self._plain: list[bytes] = []
        self._pending_counted = 0
        self._sealed = b""

    def _start_session(
        self, *, server_side: bool = True, server_hostname: str | None = None
    ) -> ssl.SSLObject:
        """Make the ``SSLObject`` and the ciphertext buffer; return the former."""
        sslobj = self._ssl = self._context.wrap_bio(
            self._incoming,
            self._outgoing,
            server_side=server_side,
            server_hostname=server_hostname,
        )
        # Starts small (an idle connection costs little) and grows to CHUNK
        # as reads fill it, i.e. when bulk data arrives.
        self._cipher = memoryview(bytearray(FIRST_CIPHER_BUFFER))
        return sslobj

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        sslobj = self._ssl
        if sslobj is None:  # a server before the client's first bytes: no session yet
            return self._inner.extra_attributes
        return {
            **self._inner.extra_attributes,
            TLSAttribute.alpn_protocol: sslobj.selected_alpn_protocol,
            TLSAttribute.channel_binding_tls_unique: sslobj.get_channel_binding,
            TLSAttribute.cipher: sslobj.cipher,
            TLSAttribute.peer_certificate: lambda: sslobj.getpeercert(False),
            TLSAttribute.peer_certificate_binary: lambda: sslobj.getpeercert(True),
            TLSAttribute.server_side: lambda: sslobj.server_side,
            TLSAttribute.shared_ciphers: lambda: (
                sslobj.shared_ciphers() if sslobj.server_side else None
            ),
            TLSAttribute.standard_compatible: lambda: True,
            TLSAttribute.ssl_object: lambda: sslobj,
            TLSAttribute.tls_version: sslobj.version,
        }

    @property
    def peer_first_bytes(self) -> bytes:
        """The first bytes the peer sent during the handshake (up to
        :data:`FIRST_BYTES_KEPT`; empty if none came): what a failed handshake
        got instead of TLS."""
        return self._peer_first_bytes

    # -- moving ciphertext -------------------------------------------------

    def _take_cipher(self, n: int) -> None:
        """Hand ``n`` received bytes of ciphertext (0: the end) to OpenSSL."""
        if n:
            cipher = self._cipher
            self._incoming.write(cipher[:n])
            if n == cipher.nbytes < CHUNK:
                self._cipher = memoryview(bytearray(min(CHUNK, 4 * n)))
        else:
            self._incoming.write_eof()
            self._cipher_ended = True

    async def _fill(self) -> None:
        """Receive ciphertext into the incoming BIO (EOF included), waiting if need
        be (handshake only: it keeps the peer's first bytes)."""
        n = await self._inner.receive_into(self._cipher)
        kept = len(self._peer_first_bytes)
        if n and kept < FIRST_BYTES_KEPT:
            self._peer_first_bytes += bytes(self._cipher[: min(n, FIRST_BYTES_KEPT - kept)])
        self._take_cipher(n)

    async def _flush(self) -> bool:
        """Send whatever ciphertext the outgoing BIO holds; return whether it waited."""
        if self._outgoing.pending:
            return await self._inner.send_all([self._outgoing.read()])
        return False

    # -- Transport ---------------------------------------------------------

    async def handshake(self) -> None:
        """Run the TLS handshake.

        Raises:
            ssl.SSLError: the handshake failed (``ssl.SSLCertVerificationError``
                for certificate problems; ``ssl.SSLEOFError`` when the peer
                closed during the handshake; ``WRONG_VERSION_NUMBER`` in its
                ``reason`` when the peer does not speak TLS, and then
                :attr:`peer_first_bytes` is what it sent instead).
            anyio.BrokenResourceError: the connection failed.
        """
        sslobj = self._ssl
        if sslobj is None:
            # A server: the client speaks first. Wait for its first bytes before
            # making the session (see the module).
            await self._inner.wait_readable()
            sslobj = self._start_session()
        limiter = self._handshake_limiter
        while True:
            try:
                if limiter is not None and self._incoming.pending:
                    await self._handshake_step(limiter)
                else:
                    sslobj.do_handshake()
            except ssl.SSLWantReadError:
                pass  # (waited for below: not with the error and its frames alive)
            except ssl.SSLZeroReturnError as exc:
                if not self._incoming.eof:
                    raise
                # OP_IGNORE_UNEXPECTED_EOF reports the TCP stream's end as the
                # session's: the error it is on every other context
                raise _unexpected_eof() from exc
            except ssl.SSLError:
                # OpenSSL wrote an alert saying why (unknown CA, no certificate,
                # ...): send it, so the peer sees the reason rather than an EOF.
                # It writes none for bytes that are no TLS record at all: a
                # server answers a client that does not speak TLS itself.
                first = self._peer_first_bytes
                if (
                    sslobj.server_side
                    and not self._outgoing.pending
                    and first
                    and not looks_like_tls_record(first)
                ):
                    self._outgoing.write(NOT_TLS_ALERT)
                with contextlib.suppress(BrokenResourceError, ClosedResourceError):
                    await self._flush()
                raise
            else:
                break
            await self._flush()
            await self._fill()
        await self._flush()

    async def _handshake_step(self, limiter: CapacityLimiter) -> None:
        """``do_handshake()`` on the ciphertext received, in a worker thread that
        holds one of ``limiter``'s tokens (the event loop runs on meanwhile).

        Cancellation is immediate while waiting for a token; a step that runs
        completes first (OpenSSL's part cannot be interrupted, and the SSLObject
        must not be used by two threads).
        """
        outcome = await anyio.to_thread.run_sync(self._try_handshake, limiter=limiter)
        if outcome is not None:
            try:
                raise outcome
            finally:
                outcome = None  # (no cycle through this frame)

    def _try_handshake(self) -> ssl.SSLError | None:
        """``do_handshake()``, its error returned rather than raised, without its
        traceback (in a worker thread)."""
        sslobj = self._ssl
        assert sslobj is not None  # (made before the handshake's first step)
        try:
            sslobj.do_handshake()
        except ssl.SSLError as exc:
            # (a traceback would hold the worker's frames, which hold the error)
            return exc.with_traceback(None)
        return None

    def receive_into_nowait(self, buffer: memoryview) -> int | None:
        sslobj = self._ssl
        if sslobj is None:  # a server whose handshake() did not run: read() runs it
            sslobj = self._start_session()
        incoming = self._incoming
        nbytes = buffer.nbytes
        received = 0
        self.drained = False
        while True:
            if self._closed:
                raise ClosedResourceError
            if self._tls_error is not None:
                raise BrokenResourceError(f"TLS error: {self._tls_error}") from self._tls_error
            # OpenSSL has nothing to work on when no ciphertext is buffered, no
            # plaintext held, no end fed to it and the session neither ended nor
            # failed in a read that returned bytes first (Python never turns
            # read-ahead on, so a record it holds in part needs more bytes):
            # receive first, rather than have read() say so with an
            # SSLWantReadError, which cost an exception or two per message.
            if incoming.pending or incoming.eof or self._read_again or sslobj.pending():
                try:
                    # One call decrypts at most one record (16 KiB): keep going
                    # while ciphertext is buffered, so a large frame costs one pass
                    # of the receive loop per ciphertext chunk, not per record.
                    # With a buffer, read() returns a count (typeshed says bytes).
                    count: int = sslobj.read(  # type: ignore[assignment]
                        nbytes - received, buffer[received:] if received else buffer
                    )
                    if not count:  # the session ended
                        return self._end_of_session(received, None)
                    received += count
                    if received == nbytes:
                        return received
                    if not (incoming.pending or sslobj.pending()):
                        # OpenSSL holds nothing: empty if the socket is (and its
                        # end, if it came, was not fed to OpenSSL yet).
                        self.drained = self._inner.drained and not incoming.eof
                        return received
                    continue
                except ssl.SSLWantReadError:
                    if received:
                        return received
                except ssl.SSLZeroReturnError as exc:
                    return self._end_of_session(received, exc)
                except ssl.SSLEOFError as exc:
                    if received:
                        self._read_again = True
                        return received
                    raise BrokenResourceError(RAGGED_EOF) from exc
                except ssl.SSLError as exc:
                    if received:
                        # raised by the next call (OpenSSL would then report an
                        # end of file instead): without its traceback, which
                        # holds this frame
                        self._tls_error = exc.with_traceback(None)
                        return received
                    raise BrokenResourceError(f"TLS error: {exc}") from exc
            n = self._inner.receive_into_nowait(self._cipher)
            if n is None:
                return None
            self._take_cipher(n)

    def _end_of_session(self, received: int, error: ssl.SSLError | None) -> int:
        """OpenSSL reported the end of the session: ``received`` if that was
        ``close_notify`` (0 is a clean end of stream).

        Raises:
            anyio.BrokenResourceError: the TCP stream ended without
                ``close_notify`` (a ragged EOF, reported as the end of the session
                under ``OP_IGNORE_UNEXPECTED_EOF``: see the module docstring).
        """
        self._read_again = True  # (OpenSSL took close_notify: it says so again)
        # After close_notify OpenSSL never asks for ciphertext again, so the
        # end of the TCP stream was fed to it (after it asked, with nothing
        # received) only if this is a ragged EOF.
        if self._incoming.eof:
            raise BrokenResourceError(RAGGED_EOF) from error
        return received

    async def wait_readable(self) -> None:
        if self._closed:
            raise ClosedResourceError
        await self._inner.wait_readable()

    def peer_reset(self) -> bool:
        return self._inner.peer_reset()

    def readable(self) -> None:
        self._inner.readable()

    def start_reading(self, callback: Callable[[], None]) -> bool:
        return self._inner.start_reading(callback)

    def stop_reading(self) -> None:
        self._inner.stop_reading()

    @property
    def send_interrupted(self) -> bool:
        return self._send_interrupted

    def send_waits(self) -> tuple[int, float]:
        return self._inner.send_waits()  # (the ciphertext's writes wait there)

    async def send_all(self, buffers: Sequence[Buffer]) -> bool:
        if self._closed or self._eof:
            raise ClosedResourceError
        sslobj = self._ssl
        if sslobj is None:  # a server whose handshake() did not run: write() runs it
            sslobj = self._start_session()
        encrypted = False
        waited = False
        self._sending = True
        try:
            if self._plain:
                # What was queued behind goes first: its ciphertext is the inner
                # queue's (_seal), which goes back to that queue if this send is
                # cancelled before writing, as a queue of plain bytes does; this
                # send's message, reported not sent then, must not go with it.
                self._encrypt_plain()
                self._sealed = self._outgoing.read()
            for buffer in buffers:
                view = memoryview(buffer).cast("B")
                for offset in range(0, view.nbytes, SEND_CHUNK):
                    sslobj.write(view[offset : offset + SEND_CHUNK])
                    encrypted = True
                    if self._outgoing.pending >= SEND_CHUNK:
                        waited |= await self._flush()
            waited |= await self._flush()  # the rest, or records a read produced
        except ssl.SSLError as exc:
            self._send_interrupted = True
            raise BrokenResourceError(f"TLS error: {exc}") from exc
        except BaseException:
            # Ciphertext may be half-sent, or encrypted but unsent: the record
            # sequence (and our framing) cannot be resumed.
            if encrypted or self._inner.send_interrupted:
                self._send_interrupted = True
            raise
        finally:
            self._sending = False
        return waited

    def send_later(self, buffers: Sequence[Buffer]) -> bool:
        # Kept as plaintext, with room reserved on the inner transport's queue for
        # its ciphertext: whatever takes that queue first seals it (_seal), so a
        # batch of small sends is one encryption, and as few records as 16 KiB
        # each allow (the peer decrypts each record in one call). Not over
        # BEHIND_LIMIT in all: the reservation bounds the ciphertext.
        if (
            self._ssl is None
            or self._closed
            or self._eof
            or self._send_interrupted
            or self._sending
        ):
            return False
        # records a read produced since the last reservation go with the batch
        pending = self._outgoing.pending
        bound = max(0, pending - self._pending_counted)
        kept: list[bytes] = []
        for buffer in buffers:
            if type(buffer) is not bytes:
                return False
            bound += len(buffer) + RECORD_OVERHEAD * (len(buffer) // MAX_RECORD + 1)
            kept.append(buffer)
        if not self._inner.seal_later(bound, self._seal):
            return False
        self._plain += kept
        self._pending_counted = pending
        return True

    def _encrypt_plain(self) -> None:
        """Encrypt the plaintext :meth:`send_later` kept into the outgoing BIO.

        Raises:
            ssl.SSLError: the session failed (and cannot send any more).
        """
        plain = self._plain
        if plain:
            self._plain = []
            self._pending_counted = 0
            sslobj = self._ssl
            assert sslobj is not None  # (send_later keeps nothing without one)
            try:
                sslobj.write(plain[0] if len(plain) == 1 else b"".join(plain))
            except ssl.SSLError:
                self._send_interrupted = True
                raise

    def _seal(self) -> bytes:
        """The inner transport takes its queue: the ciphertext of the plaintext
        kept since (with records a read produced before it), which a send may
        have encrypted first.

        Raises:
            ssl.SSLError: the session failed (the kept messages are lost).
        """
        sealed = self._sealed
        if sealed:
            self._sealed = b""
            return sealed
        if not self._plain:
            # Whatever is in the outgoing BIO now belongs to a send under way,
            # or to the next one: it must not go ahead of what that send read.
            return b""
        self._encrypt_plain()
        return self._outgoing.read()

    async def send_eof(self) -> None:
        # The cancellation point comes first, as on TCP: once close_notify is
        # encrypted, returning normally is the only way to say it was sent.
        await anyio.lowlevel.checkpoint()
        if self._closed:
            raise ClosedResourceError
        if not self._eof:
            sslobj = self._ssl
            if sslobj is None:
                sslobj = self._start_session()
            try:
                self._encrypt_plain()  # (what was queued behind goes first)
            except ssl.SSLError as exc:
                raise BrokenResourceError(f"TLS error: {exc}") from exc
            # unwrap() reads the incoming BIO for the peer's close_notify, and
            # refuses records of data it finds there first (they would be lost):
            # the ciphertext not read yet is held out of the BIO meanwhile.
            incoming = self._incoming
            held = incoming.read() if incoming.pending and not self._cipher_ended else b""
            try:
                sslobj.unwrap()
            except ssl.SSLWantReadError:
                pass  # our close_notify is out; the peer's is not needed to go on reading
            except ssl.SSLError as exc:
                raise BrokenResourceError(f"TLS error: {exc}") from exc
            else:
                # It took the peer's close_notify from the incoming BIO: the next
                # read must ask OpenSSL, which says the session ended
                self._read_again = True
            finally:
                if held:
                    incoming.write(held)
            # From here on the session cannot send data (send_all raises
            # ClosedResourceError, as after a completed send_eof): if the write
            # below is cancelled before it wrote anything, calling send_eof()
            # again (or aclose()) sends the close_notify.
            self._eof = True
            self._unsent = self._outgoing.read()
        if self._unsent:
            inner = self._inner
            if inner.send_interrupted:
                raise BrokenResourceError("a cancelled send_eof() wrote part of close_notify")
            await inner.send_all([self._unsent])
            self._unsent = b""

    def abort(self) -> None:
        self._closed = True
        self._inner.abort()

    async def aclose(self) -> None:
        if self._sending:
            # Another task is in the middle of writing a message: a close_notify
            # now would interleave with its records. Close abruptly instead; the
            # peer sees a broken connection, which is what a half-sent message is.
            self.abort()
        if not self._closed:
            self._closed = True
            sslobj = self._ssl
            try:
                if sslobj is not None:  # (no session: the client never spoke)
                    self._encrypt_plain()  # (what was queued behind goes first)
                    sslobj.unwrap()
            except ssl.SSLError:
                pass
            if (
                (self._unsent or self._outgoing.pending)
                and not self._send_interrupted  # (records lost: the peer could not read it)
                and not self._inner.send_interrupted
            ):
                with CancelScope(shield=True) as scope:
                    scope.deadline = anyio.current_time() + CLOSE_NOTIFY_TIMEOUT
                    try:
                        await self._inner.send_all([self._unsent + self._outgoing.read()])
                    except (BrokenResourceError, ClosedResourceError):
                        pass
        await self._inner.aclose()
