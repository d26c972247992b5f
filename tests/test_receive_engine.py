"""``Options.receive_engine``: which engine reads, as the options docs say, and the
same messages either way, on every backend and transport."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import anyio_comm
from anyio_comm import Comm
from anyio_comm._receivers import PullReceiver, PushReceiver

from .helpers import TRANSPORTS, connected_pair

pytestmark = pytest.mark.anyio

#: the transports whose comms the event loop's readiness callback reads with "auto"
#: on asyncio and uvloop
PUSHED = {"tcp", "tcp6", "unix", "tls1.2", "tls1.3"}


def engine(comm: Comm) -> type:
    return type(comm._receiver)


async def passes(sender: Comm, receiver: Comm, message: Any) -> Any:
    """``message`` sent by ``sender`` (in a task: it may not fit the socket's
    buffers), as ``receiver`` receives it."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(sender.send, message)
        with anyio.fail_after(10):
            return await receiver.receive()


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("receive_engine", ["auto", "pull"])
async def test_the_engine_that_reads_and_what_it_delivers(
    kind: str, receive_engine: str, anyio_backend_name: str
) -> None:
    async with connected_pair(kind, receive_engine=receive_engine) as (client, server):
        pushed = receive_engine == "auto" and anyio_backend_name == "asyncio" and kind in PUSHED
        expected = PushReceiver if pushed else PullReceiver
        assert engine(client) is expected and engine(server) is expected
        # small messages, a large frame read directly, and a many-frame message
        large = bytes(range(256)) * 4096  # 1 MiB
        many = [b"x" * (i % 70) for i in range(100)]
        for message in ({"n": 1}, large, {"frames": 3}):
            assert await passes(client, server, message) == message
        await client.send_frames([memoryview(frame) for frame in many])
        with anyio.fail_after(10):
            assert [bytes(frame) for frame in await server.receive_frames()] == many
        assert await passes(server, client, large) == large


async def test_receive_engine_is_an_option_of_every_way_to_open_a_comm() -> None:
    options = anyio_comm.Options(receive_engine="pull")
    async with connected_pair("tcp", options=options) as (client, server):
        assert engine(client) is PullReceiver and engine(server) is PullReceiver
