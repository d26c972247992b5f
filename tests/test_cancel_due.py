"""The comm's cancellation predicate (``Backend.cancel_due``) answers as the
backend's ``checkpoint_if_cancelled()`` does, on every backend, in every
arrangement of cancel scopes; where the backend's layout is not the one it
reads, it always answers yes (and the comm awaits the check itself)."""

from __future__ import annotations

import anyio
import pytest
from anyio import get_cancelled_exc_class
from anyio.lowlevel import checkpoint_if_cancelled

from anyio_comm import _backend
from anyio_comm._backend import current_backend

from .helpers import SCOPE_ARRANGEMENTS, in_scopes, unknown_task_layout

pytestmark = pytest.mark.anyio


async def answers(arrange: str) -> tuple[bool, bool]:
    """Inside the scopes ``arrange`` names (see ``in_scopes``): what the predicate
    said, and whether ``checkpoint_if_cancelled()`` then raised."""
    cancel_due = current_backend().cancel_due
    said: list[bool] = []
    raised: list[bool] = []

    async def body() -> None:
        said.append(cancel_due())
        try:
            await checkpoint_if_cancelled()
        except get_cancelled_exc_class():
            raised.append(True)
            raise
        raised.append(False)

    await in_scopes(arrange, body)
    return said[0], raised[0]


@pytest.mark.parametrize("arrange", SCOPE_ARRANGEMENTS)
async def test_it_answers_as_the_check_raises(arrange: str) -> None:
    said, raised = await answers(arrange)
    assert said is raised
    assert raised is ("c" in arrange.split("s")[-1])  # cancelled inside the last shield


async def test_a_passed_deadline_is_due() -> None:
    cancel_due = current_backend().cancel_due
    with anyio.move_on_after(0) as scope:
        assert cancel_due()
        await checkpoint_if_cancelled()
    assert scope.cancelled_caught
    with anyio.move_on_after(60):
        assert not cancel_due()
        await checkpoint_if_cancelled()


async def test_the_comm_paths_read_the_layout(anyio_backend_name: str) -> None:
    """The predicate is the fast one on the layouts of today's AnyIO and trio
    (not the fallback that always answers yes)."""
    assert current_backend().cancel_due is not _backend._always


async def test_an_unknown_layout_always_answers_yes(
    anyio_backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with unknown_task_layout(monkeypatch, trio=anyio_backend_name == "trio"):
        assert current_backend().cancel_due is _backend._always
    assert current_backend().cancel_due is not _backend._always
