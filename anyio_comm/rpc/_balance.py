"""Which of several addresses serves the next call: round robin or the least
loaded, skipping the addresses set aside after a failure."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["Balance", "Balancer"]

#: how a pool picks among its addresses
Balance = Literal["round_robin", "least_loaded"]


class Balancer:
    """The addresses of a pool, and which of them are set aside until when.

    ``pick`` chooses among those not set aside (or, when all are, the one whose
    time aside ends first: a connection may be made again): the next in turn
    (``round_robin``), or the one with the least ``load`` (``least_loaded``;
    ties go in turn).
    """

    __slots__ = ("_addresses", "_aside", "_balance", "_clock", "_set_aside_for", "_turn")

    def __init__(
        self,
        addresses: Sequence[str],
        balance: Balance,
        set_aside_for: float,
        clock: Callable[[], float],
    ) -> None:
        self._addresses = tuple(dict.fromkeys(addresses))  # (in order, once each)
        self._balance = balance
        self._set_aside_for = set_aside_for
        self._clock = clock
        #: the addresses set aside, and until when
        self._aside: dict[str, float] = {}
        self._turn = 0

    @property
    def addresses(self) -> tuple[str, ...]:
        return self._addresses

    def pick(self, load: Callable[[str], int], avoid: str | None = None) -> str:
        """The address for the next call, if possible not ``avoid`` (the one
        that just failed it)."""
        now = self._clock()
        aside = self._aside
        usable = [a for a in self._addresses if aside.get(a, -math.inf) <= now]
        if avoid is not None and len(usable) > 1 and avoid in usable:
            usable.remove(avoid)
        if not usable:
            return min(self._addresses, key=lambda a: aside[a])
        start = self._turn % len(usable)
        self._turn += 1
        if self._balance == "round_robin":
            return usable[start]
        rotated = usable[start:] + usable[:start]
        return min(rotated, key=load)

    def set_aside(self, address: str) -> None:
        """``address`` failed: pick the others for ``set_aside_for`` seconds."""
        if address in self._addresses:
            self._aside[address] = self._clock() + self._set_aside_for

    def restore(self, address: str) -> None:
        """``address`` served a call: it is no longer set aside."""
        self._aside.pop(address, None)

    def is_set_aside(self, address: str) -> bool:
        return self._aside.get(address, -math.inf) > self._clock()
