"""What an RPC server has done, per method (:meth:`anyio_comm.rpc.Server.statistics`).

The counters are kept as calls come and end (a few additions per call); the
histograms of latency and queue wait only with ``detailed_statistics=True``,
which takes the clock twice more per call.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, final

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

#: the histograms' bucket bounds, in seconds: OpenTelemetry's advice for
#: ``rpc.server.call.duration`` (semantic conventions 1.38)
SECONDS_BOUNDS: Final = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)


@final
@dataclass(frozen=True, slots=True)
class Histogram:
    """Durations counted in buckets.

    Attributes:
        bounds: the buckets' upper bounds, in seconds, ascending.
        counts: the durations in each bucket: ``counts[i]`` those above
            ``bounds[i - 1]`` and at most ``bounds[i]``, and a last one for
            those above the last bound (one more count than bounds).
        count: the durations, in all.
        sum: their sum, in seconds.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float


class _Histogram:
    """A :class:`Histogram` as it fills."""

    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, bounds: Sequence[float] = SECONDS_BOUNDS) -> None:
        self._bounds = tuple(bounds)
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0

    def add(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> Histogram:
        counts = tuple(self._counts)
        return Histogram(self._bounds, counts, sum(counts), self._sum)


@final
@dataclass(frozen=True, slots=True)
class MethodStatistics:
    """What the calls of one method did (:attr:`ServerStatistics.methods`).

    Attributes:
        calls: calls and notifications of the method that were admitted (to
            run, or to wait for a worker or a slot).
        in_flight: those not ended yet (waiting or running).
        errors: those that ended in an error, by why: the class name of the
            exception the handler (or an interceptor) raised, the error code
            the caller got otherwise (``"deadline-exceeded"``, also for a call
            whose deadline passed while it waited; ``"invalid-arguments"``),
            or ``"lost"`` (its connection ended before it was answered).
        cancelled: calls the caller cancelled before they ended.
        latency: with ``detailed_statistics``, the seconds from each call's
            arrival to its reply (a stream's: to its end), of the calls that
            were answered; else ``None``.
        queue_wait: with ``detailed_statistics``, the seconds each call and
            notification waited for a worker and a slot before its handler
            started; else ``None``.
    """

    calls: int
    in_flight: int
    errors: Mapping[str, int]
    cancelled: int
    latency: Histogram | None
    queue_wait: Histogram | None


@final
@dataclass(frozen=True, slots=True)
class ServerStatistics:
    """What an RPC server has done (:meth:`anyio_comm.rpc.Server.statistics`).

    Attributes:
        methods: the statistics of each method the server serves, by name.
        refused: calls answered with an error before any handler ran, by the
            error code: ``"method-not-found"``, ``"bad-call"``,
            ``"unavailable"`` (shutting down), ``"overloaded"``,
            ``"deadline-exceeded"`` (the deadline passed while the call
            waited for a worker or a slot; such a call is also in its
            method's ``errors``).
        notifications_dropped: notifications dropped (an unknown method, a
            full server, a shutdown).
        calls_running: calls and notifications whose handler runs now
            (:attr:`~anyio_comm.rpc.Server.calls_running`).
    """

    methods: Mapping[str, MethodStatistics]
    refused: Mapping[str, int]
    notifications_dropped: int
    calls_running: int


class MethodCounters:
    """One method's counters, as the server keeps them."""

    __slots__ = ("calls", "cancelled", "ended", "errors", "latency", "queue_wait")

    def __init__(self, detailed: bool) -> None:
        self.calls = 0
        self.ended = 0
        self.cancelled = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.latency = _Histogram() if detailed else None
        self.queue_wait = _Histogram() if detailed else None

    def snapshot(self) -> MethodStatistics:
        return MethodStatistics(
            calls=self.calls,
            in_flight=self.calls - self.ended,
            errors=dict(self.errors),
            cancelled=self.cancelled,
            latency=None if self.latency is None else self.latency.snapshot(),
            queue_wait=None if self.queue_wait is None else self.queue_wait.snapshot(),
        )
