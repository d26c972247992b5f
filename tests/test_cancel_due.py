"""The comm's cancellation predicate (``Backend.cancel_due``) answers as the
backend's ``checkpoint_if_cancelled()`` does, on every backend, in every
arrangement of cancel scopes; where the backend's layout is not the one it
reads, it always answers yes (and the comm awaits the check itself)."""

from __future__ import annotations

import gc
import weakref

import anyio
import pytest
from anyio import get_cancelled_exc_class
from anyio.lowlevel import checkpoint, checkpoint_if_cancelled

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


def running_task(anyio_backend_name: str) -> object:
    """The backend's own object for the calling task."""
    if anyio_backend_name == "trio":
        import trio

        return trio.lowlevel.current_task()
    import asyncio

    return asyncio.current_task()


async def test_one_predicate_answers_for_each_task_that_asks() -> None:
    """Tasks taking turns with one predicate (as tasks sharing a comm do) each
    get the answer for their own scopes, however often they alternate."""
    cancel_due = current_backend().cancel_due
    answers: dict[str, list[bool]] = {"cancelled": [], "plain": []}
    turn = {"cancelled": anyio.Event(), "plain": anyio.Event()}

    async def asker(name: str, other: str) -> None:
        for _ in range(5):
            await turn[name].wait()
            turn[name] = anyio.Event()
            with anyio.CancelScope() as scope:  # noqa: ASYNC100 - the scope is what is asked about
                if name == "cancelled":
                    scope.cancel()
                answers[name].append(cancel_due())
                answers[name].append(cancel_due())  # asked twice in a row
            turn[other].set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(asker, "cancelled", "plain")
        tg.start_soon(asker, "plain", "cancelled")
        await anyio.wait_all_tasks_blocked()
        turn["plain"].set()
    assert answers == {"cancelled": [True] * 10, "plain": [False] * 10}


async def test_it_keeps_no_task_alive(anyio_backend_name: str) -> None:
    """A task that asked, and finished, is freed while the predicate lives on."""
    cancel_due = current_backend().cancel_due
    tasks: list[weakref.ref[object]] = []

    async def ask() -> None:
        tasks.append(weakref.ref(running_task(anyio_backend_name)))
        with anyio.CancelScope():  # noqa: ASYNC100 - AnyIO makes the task's state here
            assert not cancel_due()
        assert not cancel_due()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
    await checkpoint()  # the loop lets go of the finished task
    gc.collect()
    assert tasks[0]() is None
    assert not cancel_due()  # and asking again, from another task, still works


async def test_a_state_anyio_let_go_of_is_looked_up_again(anyio_backend_name: str) -> None:
    """When AnyIO drops a task's state (as ``anyio.run`` does when its function
    returns) and makes a new one when the task enters a scope again, the
    predicate reads the new one, not the one it remembered."""
    if anyio_backend_name == "trio":
        pytest.skip("trio keeps a task's cancel status itself")
    import asyncio

    from anyio._backends import _asyncio as backend

    cancel_due = current_backend().cancel_due

    async def plain_asyncio_task() -> list[bool]:
        said = []
        with anyio.CancelScope():  # noqa: ASYNC100 - AnyIO makes this task's state here
            said.append(cancel_due())
        said.append(cancel_due())
        task = asyncio.current_task()
        assert task is not None
        del backend._task_states[task]
        with anyio.CancelScope() as scope:  # noqa: ASYNC100 - and a new one here
            scope.cancel()
            said.append(cancel_due())
        return said

    assert await asyncio.create_task(plain_asyncio_task()) == [False, False, True]


async def test_it_keeps_no_anyio_state_alive(anyio_backend_name: str) -> None:
    """The state AnyIO dropped with its finished task is freed too (a state does not
    hold its task: freeing the task says nothing of it)."""
    if anyio_backend_name == "trio":
        pytest.skip("trio keeps a task's cancel status itself")
    import asyncio

    from anyio._backends import _asyncio as backend

    cancel_due = current_backend().cancel_due
    states: list[weakref.ref[object]] = []

    async def ask() -> None:
        with anyio.CancelScope():  # noqa: ASYNC100 - AnyIO makes the task's state here
            assert not cancel_due()
            task = asyncio.current_task()
            assert task is not None
            states.append(weakref.ref(backend._task_states[task]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
    gc.collect()
    assert states[0]() is None


async def test_where_nothing_is_remembered_it_answers_the_same(
    anyio_backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off CPython the predicate remembers no state and looks it up on every call."""
    if anyio_backend_name == "trio":
        pytest.skip("trio keeps a task's cancel status itself")
    import asyncio

    from anyio_comm import _cancellation

    monkeypatch.setattr(_cancellation, "_remember", _cancellation._forget)
    cancel_due = _cancellation.asyncio_cancel_due(asyncio.get_running_loop())
    assert cancel_due is not None
    with anyio.CancelScope() as scope:  # noqa: ASYNC100 - the scope is what is asked about
        assert not cancel_due()
        scope.cancel()
        assert cancel_due()
        assert cancel_due()
        with anyio.CancelScope(shield=True):  # noqa: ASYNC100 - the shield is asked about
            assert not cancel_due()


async def test_task_states_it_cannot_refer_to_weakly_are_an_unknown_layout(
    anyio_backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AnyIO whose task states take no weak references: the comm falls back to
    AnyIO's own check rather than failing on every send and receive."""
    if anyio_backend_name == "trio":
        pytest.skip("trio keeps a task's cancel status itself")
    from anyio._backends import _asyncio as backend

    from anyio_comm import _cancellation

    class TaskState:
        __slots__ = ("cancel_scope", "parent_id")

        def __init__(self, parent_id: int | None, cancel_scope: object) -> None:
            self.parent_id = parent_id
            self.cancel_scope = cancel_scope

    monkeypatch.setattr(backend, "TaskState", TaskState)
    _cancellation._anyio_layout.cache_clear()
    try:
        assert current_backend().cancel_due is _backend._always
    finally:
        monkeypatch.undo()
        _cancellation._anyio_layout.cache_clear()
    assert current_backend().cancel_due is not _backend._always
