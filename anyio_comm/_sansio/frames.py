"""The frames of a received many-frame message, held compactly.

A frame object per frame (a ``memoryview`` with its managed buffer, and a
``bytearray`` with its storage: about 380 bytes beside the frame's bytes, as
Python allocates them) costs more than 8 times what a frame shorter than about
46 bytes takes on the wire (its 8-byte length entry and its bytes), so a peer
sending thousands of empty frames would make the receiver hold 50 times what
it sent. The decoder therefore delivers a *many-frame message* (more than
:data:`~anyio_comm._sansio.wire.SMALL_COUNT` frames, some shorter than
:data:`PACK_BELOW` bytes) as a :class:`PackedFrames`: its short frames stay back
to back in one buffer, where they arrived, with 16 bytes of bookkeeping each
(an offset, and the length in the message's table), and a view of one is made
when it is indexed. Its longer frames keep their buffers and views of their
own (6.1 times their wire size at 64 bytes, less beyond).

Memory: a view of a short frame keeps that shared buffer (at most 63 bytes per
frame of the message) alive, not just its own bytes.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Final, TypeAlias, overload

if TYPE_CHECKING:
    from collections.abc import Container, Iterable

__all__ = [
    "PACK_BELOW",
    "Frames",
    "OutOfBand",
    "PackedFrames",
    "Packer",
    "ShortFrame",
    "short_frame",
]

#: frames shorter than this many bytes are packed (see the module)
PACK_BELOW: Final = 64


class PackedFrames(Sequence[memoryview]):
    """The frames of a message of many short frames, as a read-only sequence.

    ``Comm.receive_frames()`` returns one for a message of more than 32 frames
    some of which are shorter than 64 bytes (any other message comes as a
    ``list``). Indexing and iteration give a writable ``memoryview`` of each
    frame, as a list would: a short frame's view is made on each access, over
    the buffer that holds the message's short frames back to back; a longer
    frame's view is always the same object, over its own buffer. Slicing gives
    a ``list`` of views. ``list(frames)`` makes an ordinary list.

    It compares equal to a list, tuple or other :class:`PackedFrames` whose
    items compare equal, in order, and it is not hashable.
    """

    __slots__ = ("_lengths", "_own", "_view", "_where")

    def __init__(
        self, lengths: tuple[int, ...], packed: memoryview, own: Iterable[memoryview]
    ) -> None:
        """Frames of these lengths: those shorter than :data:`PACK_BELOW` bytes
        back to back in ``packed``, and the others, in order, in ``own``.

        Raises:
            ValueError: ``packed`` or ``own`` does not hold what ``lengths`` says.
        """
        where = array("q", [0]) * len(lengths)
        own_views = list(own)
        position = 0
        taken = 0
        for index, length in enumerate(lengths):
            if length < PACK_BELOW:
                where[index] = position
                position += length
            else:
                if taken >= len(own_views) or own_views[taken].nbytes != length:
                    raise ValueError(f"frame {index} of {length} bytes is not in own")
                where[index] = ~taken
                taken += 1
        if position != packed.nbytes or taken != len(own_views):
            raise ValueError("the packed buffer or own frames do not match the lengths")
        self._lengths = lengths
        self._view = packed
        self._own = own_views
        # per frame: its offset in _view (>= 0), or ~(its index in _own)
        self._where = where

    def __len__(self) -> int:
        return len(self._lengths)

    @overload
    def __getitem__(self, index: int) -> memoryview: ...

    @overload
    def __getitem__(self, index: slice) -> list[memoryview]: ...

    def __getitem__(self, index: int | slice) -> memoryview | list[memoryview]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self._lengths)))]
        where = self._where[index]  # an int out of range raises IndexError here
        if where < 0:
            return self._own[~where]
        return self._view[where : where + self._lengths[index]]

    def __iter__(self) -> Iterator[memoryview]:
        view = self._view
        own = self._own
        for where, length in zip(self._where, self._lengths, strict=True):
            yield own[~where] if where < 0 else view[where : where + length]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, tuple, PackedFrames)):
            return NotImplemented
        return len(other) == len(self._lengths) and all(
            mine == theirs for mine, theirs in zip(self, other, strict=True)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<PackedFrames: {len(self._lengths)} frames, {self.nbytes} bytes>"

    @property
    def nbytes(self) -> int:
        """The bytes of all frames."""
        return sum(self._lengths)


#: a received message's frames: a list, or a many-frame message's PackedFrames
class Packer:
    """A many-frame message as it is received: its frames shorter than
    :data:`PACK_BELOW` back to back in one buffer as they arrive, the others
    kept whole, in order, until :meth:`finish` makes its :class:`PackedFrames`.

    Args:
        lengths: the message's frame lengths.
    """

    __slots__ = ("_frames", "_lengths", "_small", "index", "partial")

    def __init__(self, lengths: tuple[int, ...]) -> None:
        self._lengths = lengths
        self._small = bytearray()
        self._frames: list[memoryview] = []
        #: the frames taken so far
        self.index = 0
        #: the bytes of the short frame :attr:`index` taken so far (it is not whole)
        self.partial = 0

    @property
    def nbytes(self) -> int:
        """The bytes of the frames taken so far."""
        return len(self._small) + sum(map(len, self._frames))

    def add(self, frame: memoryview) -> None:
        """Take frame :attr:`index`, whole (a long frame, or a compressed one)."""
        if frame.nbytes < PACK_BELOW:
            self._small += frame
        else:
            self._frames.append(frame)
        self.index += 1

    def take_short(self, data: memoryview, skip: Container[int] | None) -> int:
        """Take what ``data`` holds of the short frame :attr:`index` and of the
        short frames after it (but none in ``skip``: compressed frames); return
        how many of its bytes were taken. :attr:`index` stays where it was while
        that frame is not whole."""
        lengths = self._lengths
        count = len(lengths)
        index = self.index
        stop = data.nbytes
        end = lengths[index] - self.partial
        if end > stop:
            self._small += data
            self.partial += stop
            return stop
        index += 1
        while index < count:
            length = lengths[index]
            if length >= PACK_BELOW or end + length > stop or (skip is not None and index in skip):
                break
            end += length
            index += 1
        self._small += data[:end]
        self.partial = 0
        self.index = index
        return end

    def finish(self) -> PackedFrames:
        """The message, once every frame was taken (its short frames stay in a
        ``bytearray``, whatever the allocator: one buffer for all of them may be
        larger than a frame may be)."""
        return PackedFrames(self._lengths, memoryview(self._small), self._frames)


Frames: TypeAlias = list[memoryview] | PackedFrames


class ShortFrame(bytes):
    """The bytes of a frame shorter than :data:`PACK_BELOW`, as an out-of-band
    value of a message: a ``bytes`` subclass only so that msgpack refuses it as
    a map key, as it refuses the ``memoryview`` of a longer frame (frames of 0
    and 1 bytes share one object per value)."""

    __slots__ = ()


#: the values of frames of 0 and 1 bytes, made once (a ShortFrame takes 49 bytes
#: beside its bytes: 8 times a 1-byte frame's 9 bytes on the wire, were it made anew)
_TINY: Final = {b"": ShortFrame(), **{bytes([i]): ShortFrame(bytes([i])) for i in range(256)}}


def short_frame(frame: memoryview) -> ShortFrame:
    """The value of a frame shorter than :data:`PACK_BELOW` bytes."""
    return _TINY[frame.tobytes()] if frame.nbytes < 2 else ShortFrame(frame)


class OutOfBand:
    """The out-of-band values of a message delivered as a :class:`PackedFrames`
    (all its frames but the first), as the message layer returns them, each made
    once, when the body first refers to it: a :class:`ShortFrame` for a frame
    shorter than :data:`PACK_BELOW` bytes (49 bytes beside its bytes: with its
    8-byte place here, less than 8 times what the frame takes on the wire, where
    a ``memoryview`` and its managed buffer would not be), the frame's
    ``memoryview`` for a longer one. :meth:`view` gives a pickled object's
    buffers as views (writable), also made once each."""

    __slots__ = ("_frames", "_values", "_views")

    def __init__(self, frames: PackedFrames) -> None:
        self._frames = frames
        self._values: list[memoryview | bytes | None] = [None] * (len(frames) - 1)
        self._views: dict[int, memoryview] = {}

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, index: int) -> memoryview | bytes:
        """Value ``index`` (frame ``index + 1``); ``index`` is at least 0."""
        value = self._values[index]
        if value is None:
            frame = self._frames[index + 1]
            value = frame if frame.nbytes >= PACK_BELOW else short_frame(frame)
            self._values[index] = value
        return value

    def view(self, index: int) -> memoryview:
        """Frame ``index + 1`` as a view; ``index`` is at least 0."""
        view = self._views.get(index)
        if view is None:
            view = self._views[index] = self._frames[index + 1]
        return view
