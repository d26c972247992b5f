"""Message serialization: msgpack body plus out-of-band frames.

A message becomes a list of frames: frame 0 is the msgpack body, frames 1..N
are the out-of-band buffers, each referenced from the body by its index (in
any order: with pickle enabled, pickled objects' frames follow the others).

* Bytes-like values (``bytes``, ``bytearray``, ``memoryview``,
  ``pickle.PickleBuffer``) of at least ``oob_threshold`` bytes are not copied
  into the body: they are replaced by the msgpack extension type
  :data:`EXT_OOB` whose 4-byte big-endian payload is the index ``i`` of the
  out-of-band buffer (frame ``i + 1``). On receipt they come back as
  ``memoryview`` objects over their own frame buffer (zero-copy). Smaller
  values travel inside the body and come back as ``bytes``; so do the frames
  shorter than 64 bytes of a message delivered as a
  :class:`~anyio_comm._sansio.frames.PackedFrames` (a sender whose
  ``oob_threshold`` is under 64 may send such frames), made once per frame
  however often the body refers to it, so that a peer's many tiny frames cost
  no more than 8 times their size on the wire.
* With ``allow_pickle=True`` (trusted peers only) objects msgpack cannot
  encode are pickled with protocol 5; the pickle stream and every buffer it
  exports travel as out-of-band frames, referenced by the extension type
  :data:`EXT_PICKLE` whose payload is a sequence of 4-byte big-endian
  indices: the pickle stream's, then each of its buffers'. A receiver that did
  not opt in refuses such a message with ``RemoteProtocolError`` and never
  unpickles anything.

Tuples are encoded as msgpack arrays and come back as lists. Map keys must be
``str`` or ``bytes`` (checked when sending; a receiver rejects other keys, as
msgpack's ``strict_map_key`` does, against hash-collision attacks). Raw
``msgpack.ExtType`` values cannot be sent (they could forge out-of-band
references); msgpack's standard timestamp extension (type -1) is decoded to
``msgpack.Timestamp``.
"""

from __future__ import annotations

import functools
import pickle
import struct
from typing import TYPE_CHECKING, Any, Final

import msgpack

from .decoder import DEFAULT_DIRECT_THRESHOLD
from .errors import RemoteProtocolError, SerializationError, describe
from .frames import OutOfBand, PackedFrames

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._buffer import Buffer

__all__ = ["DEFAULT_OOB_THRESHOLD", "EXT_OOB", "EXT_PICKLE", "MAX_DEPTH", "Serializer"]

EXT_OOB: Final = 1
EXT_PICKLE: Final = 2
#: bytes-like values of at least this size travel out-of-band by default: 16 KiB, the
#: smallest frame a receiver with the default read-ahead buffer reads straight into
#: its own buffer. A smaller frame is copied out of the read-ahead buffer like the
#: body, so out-of-band it saves no copy, and a frame of its own costs each end more
#: than copying it in the body does (8 KB echoed over four connections, both ends:
#: 16-32 % less CPU per round trip in the body than out-of-band; see the
#: performance page).
DEFAULT_OOB_THRESHOLD: Final = DEFAULT_DIRECT_THRESHOLD
#: most arrays and maps nested in one another in a body (the outermost counts
#: as 1); msgpack's unpacker refuses deeper bodies, and so does the sender
MAX_DEPTH: Final = 1024

#: bodies of at least this many bytes are decoded a chunk of this size at a time:
#: msgpack's one-call decoder copies everything after a body's value into the
#: error it raises (up to the whole body, a decompressed gigabyte say), where the
#: chunked one stops after the value
CHUNKED_BODY: Final = 1024 * 1024
_INDEX = struct.Struct("!I")
_BYTES_TYPES: Final = (bytes, bytearray, memoryview, pickle.PickleBuffer)
#: exact types that never hold a buffer: passed to msgpack as they are
_LEAF_TYPES: Final = frozenset({str, int, float, bool, type(None)})
#: the out-of-band references of the first frames, made once (``ExtType`` is a
#: namedtuple whose constructor runs Python code), and their index by payload
_CACHED_REFS: Final = 256
_OOB_REFS: Final = tuple(msgpack.ExtType(EXT_OOB, _INDEX.pack(i)) for i in range(_CACHED_REFS))
_OOB_INDEX: Final = {ref.data: i for i, ref in enumerate(_OOB_REFS)}


def _oob_ref(index: int) -> msgpack.ExtType:
    """The out-of-band reference to buffer ``index``."""
    if index < _CACHED_REFS:
        return _OOB_REFS[index]
    return msgpack.ExtType(EXT_OOB, _INDEX.pack(index))


def _flat(value: Buffer) -> memoryview:
    view = memoryview(value)
    if isinstance(value, pickle.PickleBuffer):
        view = value.raw()
    if view.c_contiguous:
        return view.cast("B") if view.ndim != 1 or view.format != "B" else view
    return memoryview(view.tobytes())


class Serializer:
    """Encodes messages into frames and back.

    Args:
        oob_threshold: bytes-like values of at least this many bytes travel
            as out-of-band frames.
        allow_pickle: encode objects msgpack cannot handle with pickle
            protocol 5, and accept pickled objects from the peer. Only for
            peers you trust: unpickling runs arbitrary code.
        peer_accepts_pickle: ``False`` when the peer said it does not accept
            pickled objects (a version-2 peer that did not announce the
            ``PICKLE`` capability): then nothing is pickled, whatever
            ``allow_pickle`` says, and such a message fails to serialize.

    Raises:
        ValueError: ``oob_threshold`` is negative.
    """

    __slots__ = ("_allow_pickle", "_oob_threshold", "_pack", "_send_pickle")

    def __init__(
        self,
        *,
        oob_threshold: int = DEFAULT_OOB_THRESHOLD,
        allow_pickle: bool = False,
        peer_accepts_pickle: bool = True,
    ) -> None:
        if oob_threshold < 0:
            raise ValueError(f"oob_threshold must be >= 0, got {oob_threshold}")
        self._oob_threshold = oob_threshold
        self._allow_pickle = allow_pickle
        self._send_pickle = allow_pickle and peer_accepts_pickle
        # Without pickle the packer's options never change, so one Packer is
        # reused (msgpack.packb builds a new one per call); it clears its
        # buffer when packing fails.
        self._pack = msgpack.Packer(
            default=_no_default
            if peer_accepts_pickle or not allow_pickle
            else _peer_refuses_pickle,
            use_bin_type=True,
            datetime=False,
        ).pack

    @property
    def allow_pickle(self) -> bool:
        """Whether pickle is enabled (both directions)."""
        return self._allow_pickle

    # -- encoding ----------------------------------------------------------

    def dumps(self, message: Any) -> list[memoryview]:
        """Encode ``message`` into frames (body first).

        The returned out-of-band frames are views of the caller's buffers: do
        not modify them until the send completes.

        Raises:
            SerializationError: the message contains an unsupported type (and
                pickle is not enabled) or a map key that is not ``str`` or
                ``bytes``, is nested more than :data:`MAX_DEPTH` arrays and
                maps deep (or deeper than Python's recursion limit allows), or
                an integer does not fit in 64 bits.
        """
        cls = type(message)
        if (cls is bytes and len(message) < self._oob_threshold) or cls in _LEAF_TYPES:
            # A small message of one value (a stream's usual payload): nothing
            # to extract. Failures are described by the general path below.
            try:
                return [memoryview(self._pack(message))]
            except Exception:
                pass
        oob: list[memoryview] = []
        try:
            prepared = self._extract(message, oob)
            if self._send_pickle:
                body = msgpack.packb(
                    prepared, default=self._default_pickle(oob), use_bin_type=True, datetime=False
                )
            else:
                body = self._pack(prepared)
        except SerializationError:
            raise
        except (TypeError, ValueError, OverflowError, RecursionError, pickle.PicklingError) as exc:
            raise SerializationError(f"cannot serialize message: {exc}") from exc
        return [memoryview(body), *oob]

    def _extract(self, obj: Any, oob: list[memoryview], depth: int = 1) -> Any:
        """Return ``obj`` with large buffers replaced by out-of-band references.

        Containers are rebuilt only where something inside them changed, so a
        message without large buffers is passed to msgpack as it is. ``depth``:
        the nesting depth ``obj`` has if it is a container.
        """
        cls = type(obj)
        if cls in _LEAF_TYPES:
            return obj
        if cls is bytes:
            # Exact bytes: len() is the size in bytes; no view needed to decide.
            if len(obj) < self._oob_threshold:
                return obj
            oob.append(memoryview(obj))
            return _oob_ref(len(oob) - 1)
        if cls is dict:
            if depth > MAX_DEPTH:
                raise _too_deep()
            new: dict[Any, Any] | None = None
            threshold = self._oob_threshold
            for key, value in obj.items():
                if type(key) is not str and type(key) is not bytes:
                    raise SerializationError(
                        f"map keys must be str or bytes, not {type(key).__name__}"
                    )
                vcls = type(value)
                if vcls in _LEAF_TYPES or (vcls is bytes and len(value) < threshold):
                    continue
                replaced = self._extract(value, oob, depth + 1)
                if replaced is not value:
                    if new is None:
                        new = dict(obj)
                    new[key] = replaced
            return obj if new is None else new
        if cls is list or cls is tuple:
            if depth > MAX_DEPTH:
                raise _too_deep()
            items: list[Any] | None = None
            threshold = self._oob_threshold
            for i, value in enumerate(obj):
                vcls = type(value)
                if vcls in _LEAF_TYPES or (vcls is bytes and len(value) < threshold):
                    continue
                replaced = self._extract(value, oob, depth + 1)
                if replaced is not value:
                    if items is None:
                        items = list(obj)
                    items[i] = replaced
            return obj if items is None else items
        if cls is msgpack.ExtType:
            raise SerializationError("msgpack.ExtType values cannot be sent")
        # msgpack packs subclasses of dict as maps and of list and tuple (named
        # tuples) as arrays: their keys are checked and their contents walked too.
        if isinstance(obj, dict):
            return self._extract(dict(obj), oob, depth)
        if isinstance(obj, (list, tuple)):
            return self._extract(list(obj), oob, depth)
        if cls in _BYTES_TYPES or isinstance(obj, _BYTES_TYPES):
            view = _flat(obj)
            if view.nbytes >= self._oob_threshold:
                oob.append(view)
                return _oob_ref(len(oob) - 1)
            if cls is not bytes:
                return view.tobytes() if cls is not bytearray else obj
        return obj

    def _default_pickle(self, oob: list[memoryview]) -> Any:
        def default(obj: Any) -> msgpack.ExtType:
            buffers: list[pickle.PickleBuffer] = []
            data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
            indices = [len(oob)]
            oob.append(memoryview(data))
            for buffer in buffers:
                indices.append(len(oob))
                oob.append(_flat(buffer))
            return msgpack.ExtType(EXT_PICKLE, struct.pack(f"!{len(indices)}I", *indices))

        return default

    # -- decoding ----------------------------------------------------------

    def _ext_hook(
        self,
        oob: Sequence[memoryview] | OutOfBand,
        pending: list[_Pickled],
        code: int,
        data: bytes,
    ) -> Any:
        if code == EXT_OOB:
            index = _OOB_INDEX.get(data)  # the usual case: one of the first frames
            if index is not None and index < len(oob):
                return oob[index]
            if len(data) != 4:
                raise RemoteProtocolError("malformed out-of-band reference")
            return _oob_frame(oob, _INDEX.unpack(data)[0])
        if code == EXT_PICKLE:
            if not self._allow_pickle:
                raise RemoteProtocolError(
                    "peer sent pickled data but pickle is not enabled (allow_pickle=False)"
                )
            if not data or len(data) % 4:
                raise RemoteProtocolError("malformed pickle reference")
            indices = struct.unpack(f"!{len(data) // 4}I", data)
            stream = _oob_view(oob, indices[0])
            # Unpickled once the whole body is decoded and valid: a placeholder is
            # neither str nor bytes, so msgpack refuses it as a map key.
            placeholder = _Pickled(stream, [_oob_view(oob, i) for i in indices[1:]])
            pending.append(placeholder)
            return placeholder
        raise RemoteProtocolError(f"unknown msgpack extension type {code}")

    def _ext_hook_no_oob(self, code: int, data: bytes) -> Any:
        return self._ext_hook((), [], code, data)

    def loads(self, frames: Sequence[memoryview]) -> Any:
        """Decode a message from its frames.

        Pickled objects are unpickled once the whole body has been decoded, in
        the order of the body: nothing is unpickled from a body that is refused.

        Raises:
            RemoteProtocolError: no body frame, malformed msgpack, trailing
                bytes, a map key that is not str or bytes (an extension value
                included), an unknown extension type, an out-of-band reference
                out of range, pickled data while pickle is not enabled, or a
                pickled object that cannot be unpickled.
        """
        if len(frames) == 1:
            # The common small message: a body alone, with nothing out-of-band and
            # so nothing to unpickle. A body this refuses is decoded again below,
            # which says why.
            body = frames[0]
            if len(body) < CHUNKED_BODY:
                try:
                    return msgpack.unpackb(
                        body,
                        ext_hook=self._ext_hook_no_oob,
                        raw=False,
                        strict_map_key=True,
                        timestamp=0,
                    )
                except Exception:
                    pass
        elif not frames:
            raise RemoteProtocolError("message has no body frame")
        pending: list[_Pickled] = []
        if len(frames) == 1:
            ext_hook = self._ext_hook_no_oob  # no frame a pickled object could be in
        else:
            # (a PackedFrames' values are made once each, when the body refers to them)
            oob = frames[1:] if type(frames) is not PackedFrames else OutOfBand(frames)
            ext_hook = functools.partial(self._ext_hook, oob, pending)
        body = frames[0]
        trailing = 0
        try:
            if len(body) < CHUNKED_BODY:
                value = msgpack.unpackb(
                    body, ext_hook=ext_hook, raw=False, strict_map_key=True, timestamp=0
                )
            else:
                view = memoryview(body).cast("B")
                unpacker = msgpack.Unpacker(
                    _Chunks(view),
                    read_size=CHUNKED_BODY,
                    max_buffer_size=view.nbytes,
                    ext_hook=ext_hook,
                    raw=False,
                    strict_map_key=True,
                    timestamp=0,
                )
                value = unpacker.unpack()
                trailing = view.nbytes - unpacker.tell()
        except RemoteProtocolError:
            raise
        except msgpack.ExtraData as exc:
            trailing = len(exc.extra)
        except Exception as exc:
            # msgpack raises FormatError, StackError, ValueError, TypeError
            # (unhashable or non-str key) and UnicodeDecodeError.
            problem = describe(exc)
        else:
            if not trailing:
                if pending:
                    return _unpickle_all(value, pending)
                return value
        if trailing:
            problem = f"{trailing} byte{'s' if trailing != 1 else ''} after its value"
        # (raised here, not chained: msgpack's exceptions hold copies of the body's
        # bytes, up to all of them)
        raise RemoteProtocolError(f"malformed message body: {problem}")


class _Chunks:
    """A body as a file that msgpack's unpacker reads a chunk at a time."""

    __slots__ = ("_position", "_view")

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._position = 0

    def read(self, n: int) -> bytes:
        position = self._position
        self._position = position + n
        return self._view[position : position + n].tobytes()


class _Pickled:
    """A pickled object of a body being decoded: its stream and buffers."""

    __slots__ = ("buffers", "container", "key", "stream")

    def __init__(self, stream: memoryview, buffers: list[memoryview]) -> None:
        self.stream = stream
        self.buffers = buffers
        #: where the decoded body holds it (``None``: nowhere, a later equal
        #: map key replaced it)
        self.container: list[Any] | dict[Any, Any] | None = None
        self.key: Any = None

    def load(self) -> Any:
        try:
            return pickle.loads(self.stream, buffers=self.buffers)
        except Exception as exc:
            raise RemoteProtocolError(f"cannot unpickle: {describe(exc)}") from exc


def _unpickle_all(value: Any, pending: list[_Pickled]) -> Any:
    """``value`` with the placeholders of ``pending`` replaced by their objects,
    unpickled in the order of the body.

    The walk is iterative: the body may be nested deeper than Python's recursion
    limit allows.
    """
    if type(value) is _Pickled:
        return value.load()
    unplaced = len(pending)
    stack = [value] if type(value) is list or type(value) is dict else []
    while stack and unplaced:
        container = stack.pop()
        items = container.items() if type(container) is dict else enumerate(container)
        for key, item in items:
            cls = type(item)
            if cls is _Pickled:
                item.container = container
                item.key = key
                unplaced -= 1
            elif cls is list or cls is dict:
                stack.append(item)
    for placeholder in pending:
        if placeholder.container is not None:
            placeholder.container[placeholder.key] = placeholder.load()
    return value


def _oob_frame(oob: Sequence[memoryview] | OutOfBand, index: int) -> memoryview | bytes:
    if index >= len(oob):
        raise RemoteProtocolError(
            f"out-of-band reference {index} but the message has {len(oob)} out-of-band frames"
        )
    return oob[index]


def _oob_view(oob: Sequence[memoryview] | OutOfBand, index: int) -> memoryview:
    """Out-of-band frame ``index`` as a view (a pickled object's buffer)."""
    if index >= len(oob):
        raise RemoteProtocolError(
            f"out-of-band reference {index} but the message has {len(oob)} out-of-band frames"
        )
    return oob.view(index) if isinstance(oob, OutOfBand) else oob[index]


def _too_deep() -> SerializationError:
    return SerializationError(f"message nested more than {MAX_DEPTH} arrays and maps deep")


def _out_of_range(value: int) -> str:
    """What is wrong with an int msgpack refused (it calls the packer's default
    with the ints it cannot pack, and only with those)."""
    bits = value.bit_length()
    # (str() of an int of more than 4300 digits raises ValueError)
    shown = str(value) if bits <= 256 else f"of {bits} bits"
    return f"{type(value).__name__} {shown} is out of msgpack's range [-2**63, 2**64-1]"


def _peer_refuses_pickle(obj: Any) -> Any:
    if isinstance(obj, int):
        raise SerializationError(
            f"{_out_of_range(obj)}; pickle would carry it, but the peer does not accept "
            "pickled objects (its allow_pickle is off)"
        )
    raise SerializationError(
        f"cannot serialize object of type {type(obj).__name__!r}: the peer does not "
        "accept pickled objects (its allow_pickle is off)"
    )


def _no_default(obj: Any) -> Any:
    if isinstance(obj, int):
        raise SerializationError(_out_of_range(obj))
    raise SerializationError(
        f"cannot serialize object of type {type(obj).__name__!r} "
        "(enable allow_pickle=True for trusted peers)"
    )
