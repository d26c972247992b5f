"""anyio_comm.rpc: a call whose deadline passes is answered then, whatever it
waits for (a worker of its connection, a slot of the server's) or while its
handler runs, and one condition reaches the caller as one ``remote_type``.
Every backend; TCP, TLS and the other address transports. The calls are
written by hand, so that the reply seen is the server's, not the caller's own
deadline."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import anyio_comm
from anyio_comm import rpc
from anyio_comm.rpc._protocol import Call, ErrorCode, ErrorReply, Result, decode

from .helpers import ADDRESS_TRANSPORTS, listen_arguments

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio

KINDS = [*ADDRESS_TRANSPORTS, "tls"]
#: the deadline of the calls that wait, and how late their answer may come
TIMEOUT = 0.3
LATE = 0.05


class Methods:
    def __init__(self) -> None:
        self.gate = anyio.Event()
        self.started: list[str] = []

    async def block(self) -> str:
        await self.gate.wait()
        return "opened"

    async def quick(self, tag: str) -> str:
        self.started.append(tag)
        return tag

    async def slow(self) -> None:
        await anyio.sleep(30)


@asynccontextmanager
async def serving(kind: str, **limits: Any) -> AsyncIterator[tuple[anyio_comm.Comm, Methods]]:
    """A server with ``limits`` and a raw comm to it."""
    methods = Methods()
    async with listen_arguments(kind) as (address, server_kwargs, client_kwargs):
        async with (
            rpc.serve(address, methods, **limits, **server_kwargs) as server,
            await anyio_comm.connect(server.address, timeout=10, **client_kwargs) as comm,
        ):
            yield comm, methods


async def reply_of(comm: anyio_comm.Comm) -> Result | ErrorReply:
    reply = decode(await comm.receive())
    assert isinstance(reply, (Result, ErrorReply))
    return reply


def assert_deadline(reply: Result | ErrorReply, call_id: int, text: str) -> None:
    assert isinstance(reply, ErrorReply), reply
    assert reply.id == call_id
    assert reply.code is ErrorCode.DEADLINE_EXCEEDED
    assert reply.type == "DEADLINE_EXCEEDED"
    assert text in reply.message


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "limits",
    [{"max_calls_per_connection": 1}, {"max_calls": 1}],
    ids=["worker-of-the-connection", "slot-of-the-server"],
)
async def test_a_queued_call_is_answered_at_its_deadline(
    kind: str, limits: dict[str, int]
) -> None:
    """Behind a call that never ends, a call with a deadline is answered within
    50 ms of it (not when the slot frees: it never does here), is never run,
    and the calls behind it without a deadline still wait their turn."""
    with anyio.fail_after(20):
        async with serving(kind, **limits) as (comm, methods):
            await comm.send(Call(0, "block", [], {}, None).encode())
            await anyio.sleep(0.05)  # (block runs)
            sent = time.monotonic()
            await comm.send(Call(1, "quick", ["late"], {}, TIMEOUT).encode())
            await comm.send(Call(2, "quick", ["patient"], {}, None).encode())
            reply = await reply_of(comm)
            waited = time.monotonic() - sent
            assert_deadline(reply, 1, "'quick' waited past its deadline")
            assert TIMEOUT - 0.01 <= waited <= TIMEOUT + LATE, waited
            assert methods.started == []
            methods.gate.set()
            assert {(await reply_of(comm)).id for _ in range(2)} == {0, 2}
            assert methods.started == ["patient"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_running_call_past_its_deadline_has_the_same_remote_type(kind: str) -> None:
    with anyio.fail_after(20):
        async with serving(kind) as (comm, _methods):
            sent = time.monotonic()
            await comm.send(Call(7, "slow", [], {}, TIMEOUT).encode())
            reply = await reply_of(comm)
            assert time.monotonic() - sent <= TIMEOUT + LATE
            assert_deadline(reply, 7, "'slow' did not finish within 0.3 seconds")
