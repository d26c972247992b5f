"""The comm's cancellation check on asyncio answers as AnyIO's
``checkpoint_if_cancelled()`` does, in every arrangement of cancel scopes."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import anyio
import pytest
from anyio import CancelScope, get_cancelled_exc_class
from anyio.lowlevel import checkpoint_if_cancelled

from anyio_comm import _cancellation
from anyio_comm._backend import current_backend
from anyio_comm._cancellation import asyncio_check

from .helpers import SCOPE_ARRANGEMENTS, in_scopes

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _asyncio_only(anyio_backend_name: str) -> None:
    if anyio_backend_name != "asyncio":
        pytest.skip("trio's own checkpoint_if_cancelled is the comm's there")


def fast_check() -> Callable[[], Awaitable[None]]:
    check = asyncio_check(asyncio.get_running_loop(), checkpoint_if_cancelled)
    assert check is not checkpoint_if_cancelled  # AnyIO's layout is the one it reads
    return check


async def raises(check: Callable[[], Awaitable[None]], arrange: str) -> bool:
    """Run ``check`` inside the scopes ``arrange`` names (see ``in_scopes``);
    True if it raised the cancellation."""
    caught: list[bool] = []

    async def body() -> None:
        try:
            await check()
        except get_cancelled_exc_class():
            caught.append(True)
            raise
        caught.append(False)

    await in_scopes(arrange, body)
    return caught == [True]


@pytest.mark.parametrize("arrange", SCOPE_ARRANGEMENTS)
async def test_it_raises_where_anyio_raises(arrange: str) -> None:
    expected = await raises(checkpoint_if_cancelled, arrange)
    assert await raises(fast_check(), arrange) is expected
    assert expected is ("c" in arrange.split("s")[-1])  # cancelled inside the last shield


async def test_a_passed_deadline_is_a_cancellation() -> None:
    check = fast_check()
    with anyio.move_on_after(0.01) as scope:
        await anyio.sleep(0.05)  # cancelled here: the deadline passed
    assert scope.cancelled_caught
    with CancelScope() as outer:
        with anyio.move_on_after(0) as scope:
            await check()
            pytest.fail("the check did not raise in a scope past its deadline")
        assert scope.cancelled_caught
        outer.cancel()
        with CancelScope(shield=True):
            await check()  # shielded: returns


async def test_it_does_not_yield_when_nothing_is_cancelled() -> None:
    check = fast_check()
    ran = []

    async def other() -> None:
        ran.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        for _ in range(10):
            await check()
        assert not ran  # the other task never got a turn
    assert ran


async def test_a_task_anyio_does_not_know_is_never_cancelled_by_it() -> None:
    check = fast_check()
    done = await asyncio.get_running_loop().create_task(check())
    assert done is None


async def test_it_checks_the_task_that_calls_it() -> None:
    """One check for the connection, called by different tasks: each task's own
    scopes count."""
    check = fast_check()
    results: dict[str, bool] = {}

    async def in_cancelled_scope() -> None:
        with CancelScope() as scope:
            scope.cancel()
            await check()
        results["cancelled"] = scope.cancelled_caught

    async def in_plain_scope() -> None:
        with CancelScope() as scope:
            await check()
        results["plain"] = scope.cancelled_caught

    async with anyio.create_task_group() as tg:
        tg.start_soon(in_cancelled_scope)
        tg.start_soon(in_plain_scope)
    assert results == {"cancelled": True, "plain": False}


async def test_the_comms_use_it() -> None:
    backend = current_backend()
    assert backend.checkpoint_if_cancelled is not checkpoint_if_cancelled
    assert backend.checkpoint_if_cancelled.__qualname__.startswith("asyncio_check.")


async def test_without_the_layout_it_reads_it_is_anyio_s_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from anyio._backends import _asyncio as backend

    monkeypatch.delattr(backend.TaskState, "__init__")  # (any change of layout will do)
    monkeypatch.setattr(backend, "_task_states", object())
    _cancellation._anyio_layout.cache_clear()
    try:
        loop = asyncio.get_running_loop()
        assert asyncio_check(loop, checkpoint_if_cancelled) is checkpoint_if_cancelled
    finally:
        monkeypatch.undo()
        _cancellation._anyio_layout.cache_clear()
    assert asyncio_check(loop, checkpoint_if_cancelled) is not checkpoint_if_cancelled
