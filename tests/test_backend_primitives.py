"""The event loop's own primitives that the RPC hot paths call instead of AnyIO's
(``Backend.cancel_scope``, ``current_time`` and ``effective_deadline``) behave
as AnyIO's do, on every backend, in every arrangement of cancel scopes; where
AnyIO's layout is not the one the fast deadline reads, AnyIO's function is used."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import anyio
import pytest

from anyio_comm._backend import current_backend

from .helpers import unknown_task_layout

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

pytestmark = pytest.mark.anyio

#: Cancel scopes, outermost first: ``dN`` a scope whose deadline is N seconds
#: away, ``c`` a cancelled one, ``s`` a shielded one, ``p`` a plain one.
ARRANGEMENTS = [
    "",
    "p",
    "d5",
    "d5 d9",
    "d9 d5",
    "d5 p d9",
    "d5 s",
    "d5 s d9",
    "s d5 d9",
    "d9 s d5",
    "c d5",
    "d5 c",
    "c s d5",
    "d5 s c",
    "p p p d7",
]


async def in_scopes(arrange: str, body: Callable[[], Awaitable[None]]) -> None:
    """Await ``body()`` inside the scopes ``arrange`` names (see ARRANGEMENTS)."""
    names = arrange.split()
    if not names:
        await body()
        return
    name, rest = names[0], " ".join(names[1:])
    deadline = anyio.current_time() + float(name[1:]) if name[0] == "d" else math.inf
    with anyio.CancelScope(shield=name == "s", deadline=deadline) as scope:
        if name == "c":
            scope.cancel()
        await in_scopes(rest, body)


@pytest.mark.parametrize("arrange", ARRANGEMENTS)
async def test_effective_deadline_is_anyio_s(arrange: str) -> None:
    effective_deadline = current_backend().effective_deadline
    seen: list[tuple[float, float]] = []

    async def body() -> None:
        seen.append((effective_deadline(), anyio.current_effective_deadline()))

    await in_scopes(arrange, body)
    ours, anyio_s = seen[0]
    assert ours == anyio_s
    if "c" in arrange.split("s")[-1].split():
        assert ours == -math.inf  # cancelled inside the last shield


async def test_current_time_is_anyio_s_clock() -> None:
    clock = current_backend().current_time
    before = anyio.current_time()
    now = clock()
    after = anyio.current_time()
    assert before <= now <= after


async def test_cancel_scope_honours_its_deadline_and_cancel() -> None:
    backend = current_backend()
    start = anyio.current_time()
    with backend.cancel_scope(deadline=backend.current_time() + 0.05) as scope:
        await anyio.sleep(5)
    assert scope.cancelled_caught  # type: ignore[attr-defined]
    assert anyio.current_time() - start < 4
    with backend.cancel_scope(deadline=math.inf) as scope:
        assert anyio.current_effective_deadline() == math.inf
        scope.cancel()
        await anyio.sleep(5)
    assert scope.cancelled_caught  # type: ignore[attr-defined]
    assert anyio.current_time() - start < 4


async def test_the_deadline_reads_the_layout_on_asyncio(anyio_backend_name: str) -> None:
    """On today's AnyIO the fast reader is used, not AnyIO's function."""
    effective_deadline = current_backend().effective_deadline
    assert effective_deadline is not anyio.current_effective_deadline
    if anyio_backend_name == "trio":
        import trio

        assert effective_deadline is trio.current_effective_deadline


async def test_an_unknown_layout_falls_back_to_anyio(
    anyio_backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if anyio_backend_name == "trio":
        pytest.skip("trio's own function is used on trio: no layout is read")
    with unknown_task_layout(monkeypatch, trio=False):
        assert current_backend().effective_deadline is anyio.current_effective_deadline
    assert current_backend().effective_deadline is not anyio.current_effective_deadline
