"""A transport that owns a non-blocking TCP or Unix socket.

Theory of operation
-------------------
AnyIO's socket streams cannot receive into a caller's buffer or gather-send,
and on asyncio their socket belongs to an asyncio transport. This transport
owns the socket and uses only AnyIO's event-loop primitives, so the same code
runs on asyncio, uvloop and trio:

* receive: :meth:`~SocketTransport.receive_into_nowait` calls
  ``sock.recv_into(buffer)`` and returns ``None`` on ``EAGAIN``;
  :meth:`~SocketTransport.wait_readable` waits for the socket. When a read
  returned less than it asked for, the socket was empty then and, in a
  request/reply exchange, almost always still is: the next attempt returns
  ``None`` without the system call until a wait (or the event loop's
  readiness callback, :meth:`~SocketTransport.readable`) says otherwise. That
  saves a ``recv`` failing with ``EAGAIN`` (a system call and an exception)
  per message;
* send: ``sock.sendmsg`` over at most ``IOV_MAX`` buffers (``sock.send`` for
  one), advancing over partial writes without copying; the first call offers
  the whole message, and what is left is looked at only when it did not take
  everything (an 8 KB round trip on four connections: 3-5 % fewer
  instructions than tracking every write). A send that took less than it was offered
  (or ``EAGAIN``) left the socket full: the next waits for writability (see
  :func:`_send_once`). On asyncio and uvloop the event loop's writable
  callback sends the rest and wakes the task once all of it went
  (:class:`_LoopWriter`), elsewhere wait with :func:`anyio.wait_writable`;
* close: mark closed, :func:`anyio.notify_closing` (wakes a task blocked on
  the socket, whichever task it is, with ``ClosedResourceError``), then
  ``sock.close()``.

On asyncio and uvloop, :func:`anyio.wait_readable` registers the socket with
the event loop and unregisters it after every wait: two ``epoll_ctl`` calls
(and, on uvloop, a poll handle and an ``ioctl``) per message in a
request/reply exchange, measured at 14 us per wait on uvloop against 1.7 us
for a plain yield. :class:`_LoopReader` instead keeps the socket registered
between waits, as asyncio's own transports do. Because the readiness
notification is level-triggered, a registration that fires twice while no
task waits (a consumer that stopped reading) is dropped, so an idle reader
never spins the loop; the next wait registers again.

The kernel's socket buffers are the only buffering: a peer that stops reading
makes ``sendmsg`` return ``EAGAIN`` and our sender waits (backpressure).

The transport is also an AnyIO :class:`~anyio.abc.SocketStream`, which
provides its socket attributes (:class:`anyio.abc.SocketAttribute`).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys
import time
import weakref
from typing import TYPE_CHECKING, Any, Final

import anyio
from anyio import (
    BrokenResourceError,
    BusyResourceError,
    ClosedResourceError,
    EndOfStream,
    notify_closing,
    wait_readable,
    wait_writable,
)
from anyio.abc import SocketStream

from .._backend import current_backend
from .base import Transport
from .write_behind import BEHIND_LIMIT, trio_flusher

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence
    from types import ModuleType

    from .._sansio._buffer import Buffer
    from .write_behind import TrioFlusher

__all__ = ["SocketTransport"]

try:
    IOV_MAX: Final = min(os.sysconf("SC_IOV_MAX"), 1024)
except (AttributeError, ValueError, OSError):  # pragma: no cover
    IOV_MAX = 16  # type: ignore[misc]

_HAS_SENDMSG: Final = hasattr(socket.socket, "sendmsg")
# Linux's TCP_INFO: its first byte is the connection's state, TCP_CLOSE (7) once
# the peer reset it (None where the option is missing)
_TCP_INFO: Final = getattr(socket, "TCP_INFO", None) if sys.platform == "linux" else None
_TCP_CLOSE: Final = 7
#: seconds aclose() gives the sends queued by send_later() to be written
FLUSH_ON_CLOSE_TIMEOUT: Final = 1.0
_PROACTOR: Final = getattr(asyncio, "ProactorEventLoop", None)


def _call_weakly(
    owner: weakref.ref[Any], method: Callable[[Any], None], reader: _LoopReader
) -> None:
    """The event loop's callback in :meth:`_LoopReader.start` mode: ``method(owner)``
    while ``owner`` lives (the loop holds this function and the reader, not it)."""
    target = owner()
    if target is not None:
        method(target)
    else:
        reader.unregister()


class _LoopReader:
    """The socket's reader registration with an asyncio event loop, kept across waits.

    Two modes: :meth:`wait` returns a future done at the next readiness (a task
    waits); :meth:`start` calls a callback at every readiness until
    :meth:`unregister` (a callback-driven receiver). The callback's object is
    held through a weak reference, so that the event loop, which holds the
    registration, does not keep the receiver (and the socket) alive.
    """

    __slots__ = ("_fd", "_future", "_idle_wakeups", "_loop", "_registered")

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self._loop = loop
        self._fd = fd
        self._future: asyncio.Future[None] | None = None
        self._registered = False
        self._idle_wakeups = 0

    def _on_readable(self) -> None:
        future = self._future
        if future is not None:
            self._future = None
            if not future.done():
                future.set_result(None)
        else:
            self._idle_wakeups += 1
            if self._idle_wakeups >= 2:
                self.unregister()

    def wait(self) -> asyncio.Future[None]:
        """Return a future done once the socket is readable (or :meth:`close`
        was called). A plain function returning the future, not a coroutine:
        one frame less on every wake-up. A cancelled wait cancels the future,
        which :meth:`_on_readable` and the next :meth:`wait` then drop.

        Raises:
            NotImplementedError: the event loop has no ``add_reader``.
        """
        self._idle_wakeups = 0
        future = self._future = self._loop.create_future()
        if not self._registered:
            try:
                self._loop.add_reader(self._fd, self._on_readable)
            except BaseException:
                self._future = None
                raise
            self._registered = True
        return future

    def start(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (a bound method, its object held weakly) at every
        readiness, instead of waking :meth:`wait`'s futures.

        Raises:
            NotImplementedError: the event loop has no ``add_reader``.
        """
        owner = weakref.ref(callback.__self__)  # type: ignore[attr-defined]
        method = callback.__func__  # type: ignore[attr-defined]
        self._loop.add_reader(self._fd, _call_weakly, owner, method, self)
        self._registered = True

    def unregister(self) -> None:
        if self._registered:
            self._registered = False
            self._loop.remove_reader(self._fd)

    def release(self) -> None:
        """Unregister if called in the loop's own thread while it runs (the loop's
        registrations may only be changed there); otherwise do nothing."""
        if self._registered:
            try:
                running = asyncio.get_running_loop()
            except Exception:  # RuntimeError: no loop here (or the interpreter is exiting)
                return
            if running is self._loop:
                self.unregister()

    def close(self) -> None:
        """Unregister and wake a waiting task."""
        self.unregister()
        future, self._future = self._future, None
        if future is not None and not future.done():
            future.set_result(None)


def _send_once(sock: socket.socket, pending: list[Any], first: int) -> tuple[int, int, bool]:
    """Send what one system call takes of ``pending[first:]`` (at most ``IOV_MAX``
    buffers).

    Returns:
        The bytes sent; the index of the first buffer not sent whole (see
        :func:`_advance`); and whether the socket is full: it took less than it
        was offered, so a send now would take only what the peer read in the
        meantime. On loopback, where the peer reads while we send, trying again
        at once took the rest in many small sends (a 10 MB message on trio:
        nine sends and 29 readiness waits of the peer, against three sends and
        26 waits once a send that comes up short waits for the socket to be
        writable, which the kernel reports once a third of its buffer is free;
        5-25 % more round trips per second).

    Raises:
        BlockingIOError: the socket took nothing.
        OSError: the send failed.
    """
    count = len(pending)
    if count - first == 1 or not _HAS_SENDMSG:
        offered = first + 1
        sent = sock.send(pending[first])
    else:
        offered = min(count, first + IOV_MAX)
        sent = sock.sendmsg(pending[first:offered])
    first = _advance(pending, first, sent)
    return sent, first, first < offered


def _send_until_full(sock: socket.socket, pending: list[Any], first: int) -> tuple[int, int]:
    """Send ``pending[first:]`` until all of it is sent or the socket takes
    nothing more (on, even after a send that came up short: for a callback of the
    event loop, that costs the peer no wake-up of a task, and waiting for the
    next callback measured within noise).

    Returns:
        The bytes sent, and the index of the first buffer not sent whole
        (``len(pending)`` when all was sent).

    Raises:
        OSError: a send failed (what was sent before it is lost to the caller).
    """
    total = 0
    count = len(pending)
    try:
        while first < count:
            sent, first, _ = _send_once(sock, pending, first)
            total += sent
    except BlockingIOError:
        pass
    return total, first


def _advance(pending: list[Any], first: int, sent: int) -> int:
    """Drop the ``sent`` bytes a send took from ``pending[first:]`` (a partly sent
    buffer becomes a view of its rest); return the index of the first unsent buffer."""
    while sent:
        size = len(pending[first])  # flat byte buffers: len() is the size
        if sent >= size:
            sent -= size
            first += 1
        else:
            pending[first] = memoryview(pending[first])[sent:]
            sent = 0
    return first


class _LoopWriter:
    """Waits for writability on an asyncio event loop; registered only while a send
    waits (a full socket is rare), and :meth:`close` wakes that send.

    :meth:`send_rest` goes further: the event loop's writable callback sends the
    rest of a message itself, whenever the socket takes more, and wakes the task
    once all of it went (as asyncio's own transports write from their callback).
    A large message then costs one pass of the loop per refill of the socket's
    buffer, not two and a task switch: the buffer is refilled sooner, and on
    loopback it drains in a fraction of a millisecond.
    """

    __slots__ = ("_fd", "_first", "_future", "_loop", "_pending", "_sock", "progress")

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self._loop = loop
        self._fd = fd
        self._future: asyncio.Future[None] | None = None
        self._sock: socket.socket | None = None
        self._pending: list[Any] = []
        self._first = 0
        #: bytes the callback sent for the current send_rest()
        self.progress = 0

    def send_rest(
        self, sock: socket.socket, pending: list[Any], first: int
    ) -> asyncio.Future[None]:
        """Send ``pending[first:]`` from the writable callback; return a future done
        once all of it was sent, or failed with the ``OSError`` of a send (or done
        early by :meth:`close`). The caller cancels it with :meth:`stop`.

        Raises:
            NotImplementedError: the event loop has no ``add_writer``.
        """
        self._sock = sock
        self._pending = pending
        self._first = first
        self.progress = 0
        self._loop.add_writer(self._fd, self._on_writable_send)
        future = self._future = self._loop.create_future()
        return future

    def _on_writable_send(self) -> None:
        future = self._future
        sock = self._sock
        if future is None or future.done() or sock is None:
            self.stop()
            return
        pending = self._pending
        try:
            sent, first = _send_until_full(sock, pending, self._first)
        except OSError as exc:
            self.stop()
            future.set_exception(exc)
            return
        self.progress += sent
        if first < len(pending):
            self._first = first
            return
        self.stop()
        future.set_result(None)

    def stop(self) -> None:
        """Unregister the callback of :meth:`send_rest` (no error if none)."""
        if self._sock is not None:
            self._sock = None
            self._pending = []
            self._future = None
            self._loop.remove_writer(self._fd)

    def wait(self) -> asyncio.Future[None]:
        """Return a future done once the socket is writable (or :meth:`close` was called).

        Raises:
            NotImplementedError: the event loop has no ``add_writer``.
        """
        self._loop.add_writer(self._fd, self._on_writable)
        future = self._future = self._loop.create_future()
        return future

    def _on_writable(self) -> None:
        self._loop.remove_writer(self._fd)
        future, self._future = self._future, None
        if future is not None and not future.done():
            future.set_result(None)

    def close(self) -> None:
        """Unregister and wake a waiting send."""
        future, self._future = self._future, None
        self._sock = None
        self._pending = []
        if future is not None:
            self._loop.remove_writer(self._fd)
            if not future.done():
                future.set_result(None)


class SocketTransport(Transport, SocketStream):
    """Byte transport over a connected stream socket that this object owns."""

    buffers_data = False

    __slots__ = (
        "_behind",
        "_behind_error",
        "_behind_size",
        "_closed",
        "_flush_scheduled",
        "_flusher",
        "_loop",
        "_loop_writes",
        "_reader",
        "_seal",
        "_send_interrupted",
        "_send_wait_seconds",
        "_send_waits",
        "_sock",
        "_trio",
        "_trio_busy",
        "_trio_closed",
        "_writer",
        "_writing_behind",
        "drained",
    )

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._closed = False
        self._send_interrupted = False
        # the sends that waited for room in the socket's buffer, and for how long
        self._send_waits = 0
        self._send_wait_seconds = 0.0
        # The last recv returned less than it asked for: the socket was empty.
        self.drained = False
        backend = current_backend()
        loop = self._loop = backend.loop
        # Write-behind (see write_behind.py): the queued buffers and their size
        # (with what seal_later() reserved);
        # whether their write in the event loop's next pass is scheduled; the
        # wait for a queue the socket did not take whole, while it is written
        # on; and why such a write failed (raised by the next send).
        self._behind: list[Buffer] = []
        self._behind_size = 0
        # what seal_later() reserved room for: called when the queue is taken
        self._seal: Callable[[], bytes] | None = None
        self._flush_scheduled = False
        self._writing_behind: Callable[[], Awaitable[Any]] | None = None
        self._behind_error: Exception | None = None
        self._flusher: TrioFlusher | None = None
        # The event loop can write the rest of a queue the socket did not take
        # (add_writer: not Windows' proactor loop, where nothing could).
        self._loop_writes = loop is not None and not (
            _PROACTOR is not None and isinstance(loop, _PROACTOR)
        )
        self._reader = _LoopReader(loop, sock.fileno()) if loop is not None else None
        self._writer = _LoopWriter(loop, sock.fileno()) if loop is not None else None
        # trio's lowlevel module and exceptions on trio, None on asyncio.
        self._trio: ModuleType | None = backend.trio
        self._trio_closed: type[Exception] = ClosedResourceError
        self._trio_busy: type[Exception] = BusyResourceError
        if backend.trio is not None:
            import trio  # only ever imported under trio

            self._trio_closed = trio.ClosedResourceError
            self._trio_busy = trio.BusyResourceError

    def __del__(self) -> None:
        # Dropped without aclose(): the socket is about to be closed by the garbage
        # collector, which takes it out of epoll but not out of the event loop's own
        # map of registered descriptors, so the next socket given the same number
        # could not be registered (FileNotFoundError from epoll_ctl).
        reader = self._reader
        if reader is not None:
            reader.release()
        self._release_flusher()

    def _release_flusher(self) -> None:
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            try:
                flusher.detach()
            except RuntimeError:  # (a finalizer outside the trio run: it has ended)
                pass

    @property
    def _raw_socket(self) -> socket.socket:
        return self._sock

    def _translate(self, exc: OSError) -> Exception:
        if self._closed or exc.errno == errno.EBADF:
            return ClosedResourceError()
        return BrokenResourceError(f"connection failed: {exc}")

    async def _wait(self, readable: bool) -> None:
        if self._closed:
            raise ClosedResourceError
        if readable and self._reader is not None:
            try:
                await self._reader.wait()  # abort() wakes it through reader.close()
            except NotImplementedError:  # no add_reader (Windows' proactor loop)
                self._reader = None
            else:
                if self._closed:
                    raise ClosedResourceError
                return
        if not readable and self._writer is not None:
            try:
                await self._writer.wait()  # abort() wakes it through writer.close()
            except NotImplementedError:  # no add_writer
                self._writer = None
            else:
                if self._closed:
                    raise ClosedResourceError
                return
        trio_lowlevel = self._trio
        if trio_lowlevel is not None:
            # trio, called directly (AnyIO's wrapper looks up the backend on
            # every call): trio's notify_closing() in abort() wakes this wait,
            # whichever task is in it.
            try:
                if readable:
                    await trio_lowlevel.wait_readable(self._sock)
                else:
                    await trio_lowlevel.wait_writable(self._sock)
            except self._trio_closed:
                raise ClosedResourceError from None
            except self._trio_busy:
                raise BusyResourceError("reading from" if readable else "writing to") from None
        elif readable:
            await wait_readable(self._sock)
        else:
            await wait_writable(self._sock)
        if self._closed:
            raise ClosedResourceError

    # -- receiving -----------------------------------------------------------

    def receive_into_nowait(self, buffer: memoryview) -> int | None:
        if self._closed:
            raise ClosedResourceError
        if self.drained:
            return None
        try:
            n = self._sock.recv_into(buffer)
        except BlockingIOError:
            self.drained = True
            return None
        except OSError as exc:
            raise self._translate(exc) from exc
        self.drained = n < buffer.nbytes
        return n

    def wait_readable(self) -> Awaitable[None]:
        self.drained = False
        return self._wait(readable=True)

    def readable(self) -> None:
        self.drained = False

    def peer_reset(self) -> bool:
        sock = self._sock
        if _TCP_INFO is None or self._closed or sock.family == socket.AF_UNIX:
            return False
        try:
            return sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 1)[0] == _TCP_CLOSE
        except OSError:
            return False

    def start_reading(self, callback: Callable[[], None]) -> bool:
        reader = self._reader
        if reader is None or self._closed:
            return False
        try:
            reader.start(callback)
        except NotImplementedError:  # no add_reader (Windows' proactor loop)
            self._reader = None
            return False
        return True

    def stop_reading(self) -> None:
        if self._reader is not None:
            self._reader.unregister()

    # -- sending -------------------------------------------------------------

    @property
    def send_interrupted(self) -> bool:
        return self._send_interrupted

    async def send_all(self, buffers: Sequence[Buffer]) -> bool:
        if self._behind_size or self._writing_behind is not None or self._behind_error is not None:
            return await self._send_after_behind(buffers)
        sock = self._sock
        # A send that came up short makes the task wait for writability (see
        # _send_once); with the event loop's callback, only EAGAIN hands over to
        # it (see _LoopWriter._on_writable_send).
        wait_when_full = self._writer is None
        count = len(buffers)
        if not self._closed and (count == 1 or (count <= IOV_MAX and _HAS_SENDMSG)):
            # Fast path: the whole message offered to one system call (one buffer,
            # a small message joined with its header, or a gather write), and what
            # is left looked at only when it did not take everything.
            try:
                sent = sock.send(buffers[0]) if count == 1 else sock.sendmsg(buffers)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._send_interrupted = True
                raise self._translate(exc) from exc
            if count == 1:
                data = buffers[0]
                if sent == (len(data) if type(data) is bytes else memoryview(data).nbytes):
                    return False
                pending: list[Any] = [memoryview(data)[sent:] if sent else data]
                first = 0
            else:
                pending = list(buffers)
                if sent == sum(map(len, pending)):  # (flat byte buffers: len() is the size)
                    return False
                first = _advance(pending, 0, sent)
            sent_any = sent > 0
            full = wait_when_full or not sent_any
        else:
            sent_any = full = False
            pending = list(buffers)
            first = 0
        waited = False
        waiting_since = 0.0
        try:
            while first < count:
                if full:
                    if not waited:
                        waited = True
                        self._send_waits += 1
                        waiting_since = time.monotonic()
                    if self._writer is not None:
                        break  # the event loop's callback sends the rest (see _LoopWriter)
                    try:
                        await self._wait(readable=False)
                    except BaseException:
                        if sent_any:
                            self._send_interrupted = True
                        raise
                if self._closed:
                    raise ClosedResourceError
                try:
                    _, first, full = _send_once(sock, pending, first)
                except BlockingIOError:
                    full = True
                    continue
                except OSError as exc:
                    self._send_interrupted = True
                    raise self._translate(exc) from exc
                sent_any = True
                full = full and wait_when_full
            else:
                return waited
            return await self._send_rest(pending, first, sent_any)
        finally:
            if waited:
                self._send_wait_seconds += time.monotonic() - waiting_since

    def send_waits(self) -> tuple[int, float]:
        return (self._send_waits, self._send_wait_seconds)

    async def _send_rest(self, pending: list[Any], first: int, sent_any: bool) -> bool:
        """Have the event loop's writable callback send ``pending[first:]``; return
        once all of it went (True: the send waited)."""
        writer = self._writer
        assert writer is not None
        try:
            await writer.send_rest(self._sock, pending, first)
        except NotImplementedError:  # no add_writer: wait for writability instead
            self._writer = None
            # (this send's wait is counted already, and its seconds will be)
            counted = self._send_waits, self._send_wait_seconds
            await self.send_all(pending[first:])
            self._send_waits, self._send_wait_seconds = counted
            return True
        except OSError as exc:
            self._send_interrupted = True
            raise self._translate(exc) from exc
        except BaseException:
            writer.stop()
            if sent_any or writer.progress:
                self._send_interrupted = True
            raise
        if self._closed:
            raise ClosedResourceError
        return True

    # -- writing behind (see write_behind.py) ---------------------------------

    def send_later(self, buffers: Sequence[Buffer]) -> bool:
        if self._seal is not None:  # (it would go ahead of what was reserved)
            return False
        size = 0
        for buffer in buffers:
            if type(buffer) is not bytes:  # a caller's buffer: written before send returns
                return False
            size += len(buffer)
        if not self._can_queue(size):
            return False
        self._behind += buffers
        self._behind_size += size
        return True

    def seal_later(self, bound: int, seal: Callable[[], bytes]) -> bool:
        if (self._seal is not None and self._seal != seal) or not self._can_queue(bound):
            return False
        self._seal = seal
        self._behind_size += bound
        return True

    def _can_queue(self, size: int) -> bool:
        """Whether ``size`` more bytes may be queued now (scheduling the queue's
        write if it was not)."""
        if self._closed or self._writing_behind is not None or self._send_interrupted:
            return False
        return self._behind_size + size <= BEHIND_LIMIT and (
            self._flush_scheduled or self._schedule_flush()
        )

    def _schedule_flush(self) -> bool:
        """Have the queue written in the event loop's next pass; False if nothing can."""
        loop = self._loop
        if loop is not None:
            if not self._loop_writes:
                return False
            loop.call_soon(self._flush_soon)
        else:
            flusher = self._flusher
            if flusher is None:
                assert self._trio is not None
                flusher = self._flusher = trio_flusher(self._trio)
                if flusher is None:  # (the run is ending)
                    return False
            if not flusher.schedule(self):
                return False
        self._flush_scheduled = True
        return True

    def _take_behind(self) -> list[Any]:
        """Take the queue, sealed (see :meth:`seal_later`), leaving it empty.

        Raises:
            Exception: what the seal raised (the queue is then lost).
        """
        queue: list[Any] = self._behind
        self._behind = []
        self._behind_size = 0
        seal = self._seal
        if seal is not None:
            self._seal = None
            sealed = seal()
            if sealed:
                queue.append(sealed)
        return queue

    def _requeue(self, queue: list[Any]) -> None:
        """Put back a queue a send took and did not write any of (it was cancelled):
        it was reported sent, so it goes first, written later."""
        self._behind[:0] = queue
        self._behind_size = sum(len(buffer) for buffer in queue) + self._behind_size
        if not self._flush_scheduled:
            self._schedule_flush()

    def _write_behind_nowait(self) -> tuple[list[Any], int] | None:
        """Write the queue as far as the socket takes it now; return what it did
        not take (the buffers, and the index of the first one not sent whole)."""
        self._flush_scheduled = False
        if not self._behind_size or self._closed:
            return None
        try:
            pending = self._take_behind()
            if not pending:
                return None
            _, first = _send_until_full(self._sock, pending, 0)
        except Exception as exc:  # (OSError, or what a seal raised)
            self._behind_failed(exc)
            return None
        return (pending, first) if first < len(pending) else None

    def _behind_failed(self, exc: Exception) -> None:
        """A queued write failed: messages the caller was told were sent are lost,
        so the next send raises, and the stream is unusable for framing."""
        if not self._closed:
            self._behind_error = exc
            self._send_interrupted = True

    def _flush_soon(self) -> None:
        """The event loop's callback (asyncio, uvloop): write the queue, and have
        the writable callback write on what the socket did not take."""
        rest = self._write_behind_nowait()
        if rest is None:
            return
        writer = self._writer
        assert writer is not None
        try:
            future = writer.send_rest(self._sock, *rest)
        except NotImplementedError:  # pragma: no cover (a loop _loop_writes missed)
            self._behind_failed(OSError("the event loop cannot wait for writability"))
            return
        future.add_done_callback(self._behind_written)
        self._writing_behind = lambda: asyncio.shield(future)

    def _behind_written(self, future: asyncio.Future[None]) -> None:
        self._writing_behind = None
        if not future.cancelled() and isinstance(exc := future.exception(), Exception):
            self._behind_failed(exc)

    def flush_behind(self) -> Callable[[], Awaitable[None]] | None:
        """trio's flusher calls this: write the queue; return the coroutine
        function that writes the rest, if the socket did not take it all (run
        by the flusher's nursery; it never raises but trio's ``Cancelled``)."""
        rest = self._write_behind_nowait()
        if rest is None:
            return None
        import trio  # only ever called under trio

        pending, first = rest
        done = trio.Event()
        self._writing_behind = done.wait

        async def write_rest() -> None:
            sock = self._sock
            count = len(pending)
            index = first
            try:
                while index < count:
                    await self._wait(readable=False)  # (ClosedResourceError once closed)
                    try:
                        _, index, _ = _send_once(sock, pending, index)
                    except BlockingIOError:
                        continue
            except Exception as exc:  # (never out of the system task)
                self._behind_failed(exc)  # (nothing once closed)
            finally:
                if index < count and self._behind_error is None:  # (cancelled: the run ends)
                    self._behind_failed(OSError("the queued sends were not all written"))
                self._writing_behind = None
                done.set()

        return write_rest

    async def _send_after_behind(self, buffers: Sequence[Buffer]) -> bool:
        """:meth:`send_all` behind the queue: after the rest of an earlier queue is
        written (the send waits for it), the queue's buffers go first, in the
        same write. If the send fails or is cancelled before any byte of it was
        written, the queue is put back (its messages were reported sent)."""
        writing = self._writing_behind
        if writing is not None:
            # (the queue's rest waits for room in the socket: the peer's backpressure)
            self._send_waits += 1
            waiting_since = time.monotonic()
            try:
                await writing()
            except OSError as exc:  # (asyncio: the writable callback's failure)
                self._behind_failed(exc)
            finally:
                self._send_wait_seconds += time.monotonic() - waiting_since
        error = self._behind_error
        if error is not None:
            self._send_interrupted = True
            if isinstance(error, OSError):
                raise self._translate(error) from error
            raise BrokenResourceError(f"connection failed: {error!r}") from error
        if self._closed:
            raise ClosedResourceError
        try:
            queue = self._take_behind()
        except Exception as exc:  # (what a seal raised)
            self._behind_failed(exc)
            raise BrokenResourceError(f"connection failed: {exc!r}") from exc
        if not queue:
            return await self.send_all(buffers)
        try:
            return await self.send_all([*queue, *buffers])
        except BaseException:
            if not self._send_interrupted and not self._closed:
                self._requeue(queue)
            raise

    async def send_eof(self) -> None:
        # The cancellation point comes first: once the FIN is out, returning
        # normally is the only way to tell the caller it was sent.
        await anyio.lowlevel.checkpoint()
        if self._closed:
            raise ClosedResourceError
        if self._behind_size or self._writing_behind is not None or self._behind_error is not None:
            await self.send_all(())
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            raise self._translate(exc) from exc

    # -- anyio.abc.SocketStream ------------------------------------------------

    async def receive(self, max_bytes: int = 65536) -> bytes:
        """Receive up to ``max_bytes`` bytes (the AnyIO byte-stream interface).

        Raises:
            anyio.EndOfStream: the peer closed its side.
            anyio.ClosedResourceError: the transport was closed by us.
            anyio.BrokenResourceError: the connection failed.
        """
        buffer = bytearray(max_bytes)
        n = await self.receive_into(memoryview(buffer))
        if not n:
            raise EndOfStream
        del buffer[n:]
        return bytes(buffer)

    async def send(self, item: bytes) -> None:
        """Send ``item`` whole (the AnyIO byte-stream interface).

        Raises:
            anyio.ClosedResourceError: the transport was closed by us.
            anyio.BrokenResourceError: the connection failed.
        """
        await self.send_all([memoryview(item).cast("B")])

    # -- closing -------------------------------------------------------------

    def abort(self) -> None:
        """Close the socket now; a task waiting on it gets ClosedResourceError.

        Callable from anywhere in the event loop's thread, a task or not (a loop
        callback, a finalizer): on asyncio the waits are this transport's own and
        are woken directly. Only waits made through trio or AnyIO (trio, and
        asyncio loops without ``add_reader``) need their ``notify_closing()``,
        which works only inside a task; outside one nothing can wait that way.
        """
        if self._closed:
            return
        if self._behind_size:
            # What was queued was reported sent: give it what the socket takes
            # now, without waiting (the rest is lost, as a reset loses it).
            try:
                self._sock.send(b"".join(self._take_behind()))
            except Exception:  # (OSError, or what a seal raised: lost)
                pass
        self._closed = True
        self._release_flusher()
        sock = self._sock
        try:
            if self._reader is not None:
                self._reader.close()
            if self._writer is not None:
                self._writer.close()
            if sock.fileno() >= 0 and (self._reader is None or self._writer is None):
                if self._trio is not None:
                    self._trio.notify_closing(sock)
                else:
                    notify_closing(sock)
        except RuntimeError:  # outside a task: see above
            pass
        finally:
            sock.close()

    async def aclose(self) -> None:
        if not self._closed and (self._behind_size or self._writing_behind is not None):
            # What was queued was reported sent: write it first, even when the
            # caller is cancelled, within FLUSH_ON_CLOSE_TIMEOUT.
            with anyio.CancelScope(shield=True) as scope:
                scope.deadline = anyio.current_time() + FLUSH_ON_CLOSE_TIMEOUT
                try:
                    await self.send_all(())
                except (OSError, BrokenResourceError, ClosedResourceError):
                    pass
        self.abort()
        await anyio.lowlevel.cancel_shielded_checkpoint()
