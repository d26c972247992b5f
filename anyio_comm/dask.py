"""dask.distributed on anyio-comm: the ``anyio+tcp://`` and ``anyio+tls://`` comm backends.

Installed with the ``dask`` extra (``pip install ".[dask]"`` from a clone of the
repository), registered through the ``distributed.comm.backends`` entry-point group,
so dask finds them by scheme in every process (Nanny-spawned workers included) with
nothing imported by hand::

    from distributed import Client, LocalCluster
    cluster = LocalCluster(protocol="anyio+tcp", host="127.0.0.1")

Importing :mod:`anyio_comm` does not import this module (nor dask); dask imports
it when it first meets one of the schemes.

dask's own ``to_frames`` / ``from_frames`` stay in charge of serialization;
anyio-comm carries the frames (:meth:`anyio_comm.Comm.send_frames` and
:meth:`~anyio_comm.Comm.receive_frames`), each received into one writable buffer
of its exact size (the frames shorter than 64 bytes of a message of more than 32
frames share one). Differences from ``tcp://``, all in what users cannot
observe through dask's comm API except where noted:

* Frames are never split into ``distributed.comm.shard`` pieces: any frame goes
  in one piece and arrives in one buffer, so the receiver has nothing to merge
  (and copy).
* Frames larger than 64 KiB are received into memory of earlier frames that
  nothing holds any more (:func:`buffer_pool`), not into fresh memory: up to
  ``anyio-comm.buffer-pool.max-free`` (1 GiB) of freed frame memory stays in the
  process for about ``anyio-comm.buffer-pool.free-for`` (30 s; at most 1.5 times
  that) after it was freed, as recent unmanaged memory in dask's terms.
* ``write()`` returns once the message is handed to the kernel (with tornado,
  once it is queued in the stream's unbounded buffer): a peer that does not
  read holds the writer back instead of growing its memory.
* Writes from several tasks are serialized on the comm (a lock); a message is
  never interleaved with another.
* A connection that does not complete its handshakes within
  ``distributed.comm.timeouts.connect`` is dropped by the listener.
* Configuration used: ``distributed.comm.timeouts.connect`` (the handshake
  timeout of each attempt), ``distributed.comm.timeouts.tcp`` (TCP keepalive and,
  on Linux, the user timeout), ``distributed.comm.socket-backlog``,
  ``anyio-comm.buffer-pool.*``; TLS contexts come from dask's ``Security`` as for
  ``tls://``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import ssl
import sys
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, Final

import anyio
import dask
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream
from anyio.streams.tls import TLSAttribute
from dask.utils import parse_bytes, parse_timedelta
from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import (
    BaseListener,
    Comm,
    CommClosedError,
    Connector,
    FatalCommClosedError,
)
from distributed.comm.tcp import BaseTCPBackend, RequireEncryptionMixin
from distributed.comm.utils import ensure_concrete_host, from_frames, to_frames

import anyio_comm

from ._addressing import format_tcp, parse_address
from ._comm import bytes_sent
from ._sansio.pool import DEFAULT_MAX_SMALL_BYTES
from ._sansio.wire import Limits

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._sansio._buffer import Buffer

__all__ = [
    "AnyioTCP",
    "AnyioTCPBackend",
    "AnyioTCPConnector",
    "AnyioTCPListener",
    "AnyioTLS",
    "AnyioTLSBackend",
    "AnyioTLSConnector",
    "AnyioTLSListener",
    "dask_allocator",
    "dask_options",
]

logger = logging.getLogger(__name__)

#: dask's frames are not bounded by anything but memory: neither are ours here
#: (the header of a message is 8 bytes per frame, so max_frames bounds it to 128 MiB)
DASK_LIMITS: Final = Limits(max_frames=2**24, max_frame_size=2**64 - 1, max_message_size=2**64 - 1)

#: the buffer pool keeps at most this much memory of dropped frames, by default
POOL_MAX_FREE: Final = "1 GiB"

#: errors that mean the connection is gone (or unusable): dask's CommClosedError
_CLOSED_ERRORS: Final = (
    EndOfStream,
    ClosedResourceError,
    BrokenResourceError,
    anyio_comm.RemoteProtocolError,
)


_pool: anyio_comm.BufferPool | None = None
#: the pending trim of the pool, and its event loop
_trim_timer: asyncio.TimerHandle | None = None
_trim_loop: asyncio.AbstractEventLoop | None = None


def buffer_pool() -> anyio_comm.BufferPool:
    """The process's pool of frame buffers, made on first use from dask's configuration:
    ``anyio-comm.buffer-pool.max-free`` (default 1 GiB, and the ``bytearray``
    objects of frames of 4 to 64 KiB up to 4 MiB; 0 keeps nothing) and
    ``anyio-comm.buffer-pool.free-for`` (default: dask's
    ``distributed.worker.memory.recent-to-old-time``, 30 s, the age until which dask
    counts unmanaged memory as recent). See the dask guide.

    Raises:
        ValueError: a configured size or duration is malformed or negative.
    """
    global _pool
    if _pool is None:
        max_free = dask.config.get("anyio-comm.buffer-pool.max-free", POOL_MAX_FREE)
        free_for = dask.config.get(
            "anyio-comm.buffer-pool.free-for",
            dask.config.get("distributed.worker.memory.recent-to-old-time", "30s"),
        )
        max_free_bytes = parse_bytes(max_free) if isinstance(max_free, str) else max_free
        _pool = anyio_comm.BufferPool(
            max_free_bytes=max_free_bytes,
            free_for=parse_timedelta(free_for, default="seconds"),
            # (0 keeps nothing: nor the bytearrays of frames of 4 to 64 KiB)
            max_small_bytes=DEFAULT_MAX_SMALL_BYTES if max_free_bytes else 0,
        )
    return _pool


def dask_allocator(nbytes: int) -> Buffer:
    """The buffer a received frame goes into: above 64 KiB, memory of earlier frames
    that nothing holds any more (:func:`buffer_pool`), else a ``bytearray`` (from 4
    KiB, one of an earlier frame nothing holds any more). Always writable, never
    shared with a frame still held."""
    return buffer_pool()(nbytes)


def _keep_trimming() -> None:
    """While the pool holds memory, trim what was kept longer than ``free_for``
    every ``free_for / 2`` seconds, from the event loop of the comm that last read
    (so memory is given back at most 1.5 times ``free_for`` after it was freed)."""
    global _trim_timer, _trim_loop
    pool = _pool
    if pool is None or pool.free_for is None:
        return
    if _trim_timer is not None and not (_trim_loop is None or _trim_loop.is_closed()):
        return  # (a timer of a loop that closed never fires: schedule anew)
    statistics = pool.statistics()
    if statistics.buffers_in_use or statistics.free_buffers:
        _trim_loop = asyncio.get_running_loop()
        _trim_timer = _trim_loop.call_later(pool.free_for / 2, _trim_tick)


def _trim_tick() -> None:
    global _trim_timer
    _trim_timer = None
    if _pool is not None:
        _pool.trim(None)
        _keep_trimming()


def dask_options() -> anyio_comm.Options:
    """The options of an ``anyio+tcp://`` or ``anyio+tls://`` connection, read
    from dask's configuration when called.

    No receive limits beyond memory (:data:`DASK_LIMITS`), no message timeout
    (dask bounds nothing of the kind either), frames received into
    :func:`dask_allocator`'s buffers; ``handshake_timeout`` from
    ``distributed.comm.timeouts.connect``, ``keepalive`` from
    ``distributed.comm.timeouts.tcp``.

    Raises:
        ValueError: a configured duration is malformed or negative.
    """
    connect_timeout = parse_timedelta(
        dask.config.get("distributed.comm.timeouts.connect"), default="seconds"
    )
    tcp_timeout = parse_timedelta(
        dask.config.get("distributed.comm.timeouts.tcp"), default="seconds"
    )
    return anyio_comm.Options(
        limits=DASK_LIMITS,
        allocator=dask_allocator,
        handshake_timeout=connect_timeout or None,
        message_timeout=None,
        keepalive=tcp_timeout or None,
    )


def _dask_address(prefix: str, address: str) -> str:
    """``tcp://127.0.0.1:8786`` (an anyio-comm address) as ``anyio+tcp://127.0.0.1:8786``."""
    parsed = parse_address(address)
    return prefix + unparse_host_port(parsed.host, parsed.port)


def _expect_tls_context(connection_args: dict[str, Any]) -> ssl.SSLContext:
    context = connection_args.get("ssl_context")
    if not isinstance(context, ssl.SSLContext):
        raise TypeError(
            "TLS expects a `ssl_context` argument of type ssl.SSLContext (perhaps check "
            f"your TLS configuration?) Instead got {context!r}"
        )
    return context


def _abort_dangling(comm: anyio_comm.Comm, closed: anyio.Event, name: str) -> None:
    if not comm.closed:
        logger.warning("Closing dangling comm %s", name)
        comm.abort()
    closed.set()


class AnyioTCP(Comm):
    """A dask comm over an anyio-comm connection (``anyio+tcp://``)."""

    #: frames go whole (see the module): dask's to_frames splits none
    max_shard_size: ClassVar[int] = sys.maxsize

    def __init__(
        self,
        comm: anyio_comm.Comm,
        local_addr: str,
        peer_addr: str,
        deserialize: bool = True,
    ) -> None:
        self._closed = False
        super().__init__(deserialize=deserialize)
        self._comm = comm
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._write_lock = asyncio.Lock()
        #: set once the comm is closed (the listener's task for it then ends)
        self.closed_event = anyio.Event()
        loop = asyncio.get_running_loop()
        self._finalizer = weakref.finalize(
            self,
            loop.call_soon_threadsafe,
            _abort_dangling,
            comm,
            self.closed_event,
            f"{local_addr} -> {peer_addr}",
        )
        self._finalizer.atexit = False
        self._extra: dict[str, Any] = {}
        self._read_extra()

    def _read_extra(self) -> None:
        pass

    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def extra_info(self) -> dict[str, Any]:
        return self._extra

    def _closed_error(self, exc: BaseException) -> CommClosedError:
        cause = exc.__cause__
        if isinstance(cause, ssl.SSLError) and "UNKNOWN_CA" in (cause.reason or ""):
            return FatalCommClosedError(f"in {self}: {type(cause).__name__}: {cause}")
        return CommClosedError(f"in {self}: {type(exc).__name__}: {exc}")

    async def read(self, deserializers: Any = None) -> Any:
        """Receive a message and deserialize it with dask's ``from_frames``.

        Raises:
            CommClosedError: the comm is closed, the peer closed it, or the
                connection failed (the comm is then closed).
        """
        if self._closed:
            raise CommClosedError(f"in {self}: closed")
        try:
            frames = await self._comm.receive_frames()
            _keep_trimming()
        except _CLOSED_ERRORS as exc:
            self.abort()
            raise self._closed_error(exc) from exc
        except BaseException:
            # (cancelled, say): how much of a message was taken is unknown to the
            # caller, so the comm cannot be used again, as with tcp://
            self.abort()
            raise
        try:
            return await from_frames(  # type: ignore[no-untyped-call]
                frames,
                deserialize=self.deserialize,
                deserializers=deserializers,
                allow_offload=self.allow_offload,
            )
        except EOFError:
            self.abort()
            raise CommClosedError("aborted stream on truncated data") from None

    async def write(
        self, msg: Any, serializers: Any = None, on_error: str | None = "message"
    ) -> int:
        """Serialize a message with dask's ``to_frames`` and send it.

        Several tasks may write at once: their messages go one after another.

        Returns:
            The bytes the message took on the wire: its frames (after dask's
            compression, and anyio-comm's if the comm compresses) and its header.
            dask logs it as the transfer's compressed size.

        Raises:
            CommClosedError: the comm is closed or the connection failed (the
                comm is then closed).
            anyio_comm.LocalProtocolError: over the peer's limits (nothing sent).
        """
        if self._closed:
            raise CommClosedError(f"in {self}: closed")
        frames = await to_frames(  # type: ignore[no-untyped-call]
            msg,
            allow_offload=self.allow_offload,
            serializers=serializers,
            on_error=on_error,
            context={
                "sender": self.local_info,
                "recipient": self.remote_info,
                **self.handshake_options,
            },
            frame_split_size=self.max_shard_size,
        )
        async with self._write_lock:
            if self._closed:
                raise CommClosedError(f"in {self}: closed")
            before = bytes_sent(self._comm)
            try:
                await self._comm.send_frames(frames)
            except _CLOSED_ERRORS as exc:
                self.abort()
                raise self._closed_error(exc) from exc
            except anyio_comm.LocalProtocolError:
                raise
            except BaseException:
                self.abort()
                raise
            return bytes_sent(self._comm) - before

    async def close(self) -> None:
        """Close after the write in progress (if any), as ``tcp://`` flushes its
        buffer first."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        try:
            async with self._write_lock:
                await self._comm.aclose()
        finally:
            self._comm.abort()  # (a no-op after aclose(); cancelled: closes now)
            self.closed_event.set()

    def abort(self) -> None:
        """Close at once (synchronous)."""
        if not self._closed:
            self._closed = True
            self._finalizer.detach()
        self._comm.abort()
        self.closed_event.set()

    def closed(self) -> bool:
        """True once closed, or once the peer closed (seen on an idle comm too,
        as the event loop reads): then this end closes too."""
        if not self._closed and self._comm.receive_ended:
            self.abort()
        return self._closed


class AnyioTLS(AnyioTCP):
    """A dask comm over an anyio-comm TLS connection (``anyio+tls://``);
    ``extra_info`` holds the peer's certificate and the cipher, as with ``tls://``."""

    def _read_extra(self) -> None:
        comm = self._comm
        self._extra.update(
            peercert=comm.extra(TLSAttribute.peer_certificate),
            cipher=comm.extra(TLSAttribute.cipher),
        )
        cipher, protocol, bits = self._extra["cipher"]
        logger.debug(
            "TLS connection with %r: protocol=%s, cipher=%s, bits=%d",
            self._peer_addr,
            protocol,
            cipher,
            bits,
        )


class AnyioTCPConnector(Connector, RequireEncryptionMixin):
    """Connects ``anyio+tcp://`` addresses."""

    prefix: ClassVar[str] = "anyio+tcp://"
    comm_class: ClassVar[type[AnyioTCP]] = AnyioTCP
    encrypted: ClassVar[bool] = False

    async def connect(
        self, address: str, deserialize: bool = True, **connection_args: Any
    ) -> AnyioTCP:
        """Connect to ``host:port`` and complete anyio-comm's handshake.

        Raises:
            OSError: the connection failed in a way worth retrying (refused,
                unreachable, timed out; dask's ``connect`` retries).
            CommClosedError: the connection dropped during the handshake.
            FatalCommClosedError: a TLS error (an untrusted certificate, a
                hostname mismatch) or a peer that does not speak anyio-comm.
            RuntimeError: dask's configuration requires encryption and the
                scheme is not ``anyio+tls://``.
            ValueError: a malformed address.
        """
        self._check_encryption(address, connection_args)  # type: ignore[no-untyped-call]
        host, port = parse_host_port(address)
        ssl_context = _expect_tls_context(connection_args) if self.encrypted else None
        name = self.prefix + address
        try:
            comm = await anyio_comm.connect(
                format_tcp(host, port, "tls" if self.encrypted else "tcp"),
                options=dask_options(),
                ssl_context=ssl_context,
                server_hostname=connection_args.get("server_hostname") or None,
            )
        except ssl.SSLCertVerificationError as exc:
            raise FatalCommClosedError(
                "TLS certificate does not match. Check your security settings. "
                "More info at https://distributed.dask.org/en/latest/tls.html"
            ) from exc
        except ssl.SSLError as exc:
            # (its message names the address)
            raise FatalCommClosedError(f"TLS handshake failed: {exc}") from exc
        except anyio_comm.RemoteProtocolError as exc:
            raise FatalCommClosedError(f"{name} does not speak anyio-comm: {exc}") from exc
        except BrokenResourceError as exc:
            if isinstance(exc.__cause__, ssl.SSLError):  # rejected after the handshake
                raise FatalCommClosedError(
                    f"TLS connection to {name} rejected: {exc.__cause__}"
                ) from exc
            raise CommClosedError(f"connection to {name} dropped: {exc}") from exc
        try:
            return self.comm_class(
                comm,
                _dask_address(self.prefix, comm.local_address),
                self.prefix + address,
                deserialize,
            )
        except BaseException:
            comm.abort()
            raise


class AnyioTLSConnector(AnyioTCPConnector):
    """Connects ``anyio+tls://`` addresses (``ssl_context`` from dask's ``Security``)."""

    prefix = "anyio+tls://"
    comm_class = AnyioTLS
    encrypted = True


class AnyioTCPListener(BaseListener, RequireEncryptionMixin):
    """Listens on an ``anyio+tcp://`` address.

    :meth:`start` binds and runs an anyio-comm listener in a task of its own
    (dask's listeners outlive the call that starts them); :meth:`stop` stops
    accepting at once and does nothing else, as ``tcp://``'s does: connections
    accepted before it go on (through their TLS handshake and preamble, then
    dask's handshake) to the handler, and that task ends when the last comm it
    accepted closes. (dask's ``Server`` aborts the comms still in dask's
    handshake itself, with ``abort_handshaking_comms()``, and aborts those that
    reach its handler once it is stopped.)
    """

    prefix: ClassVar[str] = "anyio+tcp://"
    comm_class: ClassVar[type[AnyioTCP]] = AnyioTCP
    encrypted: ClassVar[bool] = False

    def __init__(
        self,
        address: str,
        comm_handler: Callable[[Comm], Any],
        deserialize: bool = True,
        allow_offload: bool = True,
        default_host: str | None = None,
        default_port: int = 0,
        **connection_args: Any,
    ) -> None:
        super().__init__()
        self._check_encryption(address, connection_args)  # type: ignore[no-untyped-call]
        self.ip, self.port = parse_host_port(address, default_port)
        self.default_host = default_host
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self._ssl_context = _expect_tls_context(connection_args) if self.encrypted else None
        self._listener: anyio_comm.Listener | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self.bound_address: tuple[str, int] | None = None

    async def start(self) -> None:
        """Bind and start accepting.

        Raises:
            OSError: the address could not be bound.
        """
        if self._task is not None:
            raise RuntimeError("the listener was started already")
        backlog = int(dask.config.get("distributed.comm.socket-backlog"))
        address = format_tcp(self.ip, self.port, "tls" if self.encrypted else "tcp")
        for attempt in range(5):
            loop = asyncio.get_running_loop()
            started: asyncio.Future[anyio_comm.Listener] = loop.create_future()
            task = loop.create_task(
                self._serve(address, backlog, started), name=f"dask listener {address}"
            )
            try:
                self._listener = await asyncio.shield(started)
            except OSError as exc:
                # EADDRINUSE can happen when an ephemeral port is taken on one
                # family after the other got it (as tornado's listener retries)
                if self.port != 0 or exc.errno != errno.EADDRINUSE or attempt == 4:
                    raise
                continue
            except BaseException:
                task.cancel()
                raise
            self._task = task
            break
        self.get_host_port()

    async def _serve(
        self, address: str, backlog: int, started: asyncio.Future[anyio_comm.Listener]
    ) -> None:
        try:
            async with anyio_comm.listen(
                address,
                self._handle,
                options=dask_options(),
                receive_budget=None,
                backlog=backlog,
                ssl_context=self._ssl_context,
            ) as listener:
                started.set_result(listener)
                await listener.wait_closed()  # stop() and every comm closed
        except Exception as exc:
            if started.done():
                logger.exception("listener on %s failed", address)
            else:
                started.set_exception(exc)

    async def _handle(self, comm: anyio_comm.Comm) -> None:
        # (A comm accepted before stop() and handshaken after it goes on too:
        # tcp:// closes one that its task had not reached, when a client would
        # wait forever in dask's handshake, which has no timeout. This one is
        # served: its client is answered, and a stopped Server aborts it.)
        dask_comm: AnyioTCP | None = None
        try:
            dask_comm = self.comm_class(
                comm,
                _dask_address(self.prefix, comm.local_address),
                _dask_address(self.prefix, comm.peer_address),
                self.deserialize,
            )
            dask_comm.allow_offload = self.allow_offload
            closed = dask_comm.closed_event
            try:
                await self.on_connection(dask_comm)
            except CommClosedError:
                logger.info(
                    "Connection from %s closed before handshake completed",
                    dask_comm.peer_address,
                )
                return
            logger.debug(
                "Incoming connection from %r to %r",
                dask_comm.peer_address,
                dask_comm.local_address,
            )
            await self.comm_handler(dask_comm)
            # The comm is dask's now, until it closes it (or drops it: its
            # finalizer closes it then); this task only waits for that.
            dask_comm = None
            await closed.wait()
        finally:
            if dask_comm is not None:  # failed or cancelled before dask took it
                dask_comm.abort()

    def stop(self) -> None:
        """Stop accepting (synchronous), and nothing else: the comms accepted
        before it, those still in a handshake included, live on until closed."""
        if self._stopped:
            return
        self._stopped = True
        if self._listener is not None:
            self._listener.stop_accepting()

    def get_host_port(self) -> tuple[str, int]:
        """The listening address as ``(host, port)``.

        Raises:
            ValueError: the listener was not started.
        """
        if self._listener is None or self._stopped:
            raise ValueError("invalid operation on non-started listener")
        if self.bound_address is None:
            addresses = [parse_address(a) for a in self._listener.addresses]
            # IPv4 first, as dask's own listener reports (0.0.0.0 for every interface)
            chosen = next((a for a in addresses if ":" not in a.host), addresses[0])
            self.bound_address = (chosen.host, chosen.port)
        return self.bound_address

    @property
    def listen_address(self) -> str:
        """The listening address (``anyio+tcp://0.0.0.0:8786`` for every interface)."""
        return self.prefix + unparse_host_port(*self.get_host_port())

    @property
    def contact_address(self) -> str:
        """An address to reach this listener at (a concrete host for every interface)."""
        host, port = self.get_host_port()
        host = ensure_concrete_host(host, default_host=self.default_host)  # type: ignore[no-untyped-call]
        return self.prefix + unparse_host_port(host, port)


class AnyioTLSListener(AnyioTCPListener):
    """Listens on an ``anyio+tls://`` address (``ssl_context`` from dask's ``Security``)."""

    prefix = "anyio+tls://"
    comm_class = AnyioTLS
    encrypted = True


class AnyioTCPBackend(BaseTCPBackend):
    """The ``anyio+tcp`` scheme (entry point ``distributed.comm.backends``)."""

    _connector_class = AnyioTCPConnector
    _listener_class = AnyioTCPListener


class AnyioTLSBackend(BaseTCPBackend):
    """The ``anyio+tls`` scheme (entry point ``distributed.comm.backends``)."""

    _connector_class = AnyioTLSConnector
    _listener_class = AnyioTLSListener
