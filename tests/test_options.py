"""Options: one object for every function that opens a comm, keywords still accepted."""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import pytest

import anyio_comm
from anyio_comm import Comm, Limits, Options
from anyio_comm.testing import comm_pair, memory_byte_stream_pair

from .certs import client_context, server_context
from .helpers import listen_address


def test_defaults() -> None:
    options = Options()
    assert options.limits == Limits()
    assert options.read_buffer_size == 65536
    assert options.oob_threshold == 16384
    assert options.handshake_timeout == 10.0
    assert options.idle_timeout is None and options.keepalive is None
    assert options.allocator is None and options.allow_pickle is False
    assert options.receive_engine == "auto"


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"read_buffer_size": 10}, ValueError, "read_buffer_size"),
        ({"read_buffer_size": 65536.0}, TypeError, "read_buffer_size"),
        ({"oob_threshold": -1}, ValueError, "oob_threshold"),
        ({"oob_threshold": True}, TypeError, "oob_threshold"),
        ({"handshake_timeout": 0}, ValueError, "handshake_timeout"),
        ({"idle_timeout": float("nan")}, ValueError, "idle_timeout"),
        ({"keepalive": "5"}, TypeError, "keepalive"),
        ({"limits": {"max_frames": 1}}, TypeError, "limits"),
        ({"allocator": 42}, TypeError, "allocator"),
        ({"allow_pickle": 1}, TypeError, "allow_pickle"),
        ({"receive_engine": "push"}, ValueError, "receive_engine must be one of 'auto', 'pull'"),
        ({"receive_engine": None}, TypeError, "receive_engine must be a str"),
    ],
)
def test_bad_fields_fail_where_the_options_are_made(
    fields: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Options(**fields)


def test_options_are_immutable_and_replaceable() -> None:
    options = Options(idle_timeout=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.idle_timeout = 1  # type: ignore[misc]
    assert dataclasses.replace(options, idle_timeout=1).idle_timeout == 1
    with pytest.raises(ValueError, match="idle_timeout"):
        dataclasses.replace(options, idle_timeout=-1)


async def echo(comm: Comm) -> None:
    async for message in comm:
        await comm.send(message)


@pytest.mark.parametrize("kind", ["tcp", "unix", "inproc", "tls1.3"])
async def test_connect_and_listen_take_options_and_keywords(kind: str) -> None:
    """A keyword overrides the field of ``options=``; each side announces its own limits."""
    server_limits = Limits(max_frames=100)
    client_limits = Limits(max_frames=200)
    server_tls: dict[str, Any] = {}
    client_tls: dict[str, Any] = {}
    if kind == "tls1.3":
        server_tls = {"ssl_context": server_context()}
        client_tls = {"ssl_context": client_context()}
    received: list[Comm] = []

    async def handler(comm: Comm) -> None:
        received.append(comm)
        await echo(comm)

    base = Options(idle_timeout=99, oob_threshold=100)
    async with listen_address(kind) as address:
        async with anyio_comm.listen(
            address, handler, options=base, limits=server_limits, **server_tls
        ) as listener:
            comm = await anyio_comm.connect(
                listener.address, options=base, idle_timeout=30, limits=client_limits, **client_tls
            )
            async with comm:
                assert comm.idle_timeout == 30  # the keyword won
                assert comm.peer_handshake.limits == server_limits
                await comm.send({"data": b"x" * 200})  # over oob_threshold: a frame
                with anyio.fail_after(10):
                    reply = await comm.receive()
                assert isinstance(reply["data"], memoryview)
                assert received[0].idle_timeout == 99
                assert received[0].peer_handshake.limits == client_limits


async def test_serve_from_stream_and_comm_pair_take_options() -> None:
    options = Options(idle_timeout=7)
    async with anyio.create_task_group() as tg:
        listener = await tg.start(
            lambda task_status: anyio_comm.serve(
                "inproc://", echo, task_status=task_status, options=options
            )
        )
        async with await anyio_comm.connect(listener.address, options=options) as comm:
            assert comm.idle_timeout == 7
        tg.cancel_scope.cancel()
    client, server = await comm_pair(options=options, oob_threshold=10)
    async with client, server:
        assert client.idle_timeout == server.idle_timeout == 7
        await client.send(b"y" * 20)
        assert isinstance(await server.receive(), memoryview)
    a, b = memory_byte_stream_pair()
    comms: list[Comm] = []

    async def open_one(stream: Any) -> None:
        comms.append(await anyio_comm.from_stream(stream, options=options, idle_timeout=3))

    async with anyio.create_task_group() as tg:
        tg.start_soon(open_one, a)
        tg.start_soon(open_one, b)
    for comm in comms:
        assert comm.idle_timeout == 3
        await comm.aclose()


@pytest.mark.parametrize("function", ["connect", "listen", "from_stream", "comm_pair"])
async def test_unknown_keywords_and_wrong_options_are_type_errors(function: str) -> None:
    async def call(**keywords: Any) -> None:
        if function == "connect":
            await anyio_comm.connect("inproc://nobody", **keywords)
        elif function == "listen":
            async with anyio_comm.listen("inproc://", echo, **keywords):
                pass
        elif function == "from_stream":
            a, b = memory_byte_stream_pair()
            async with b:
                await anyio_comm.from_stream(a, **keywords)
        else:
            await comm_pair(**keywords)

    with pytest.raises(TypeError, match=f"{function}.*no_such_option"):
        await call(no_such_option=1)
    with pytest.raises(TypeError, match=r"anyio_comm\.Options"):
        await call(options={"idle_timeout": 1})
    with pytest.raises(ValueError, match="idle_timeout"):
        await call(idle_timeout=-1)


async def test_connect_handshake_timeout() -> None:
    """handshake_timeout bounds each attempt's handshake even without ``timeout``."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as silent:
        port = silent.extra(anyio.abc.SocketAttribute.local_port)
        with anyio.fail_after(5), pytest.raises(TimeoutError, match="handshake_timeout"):
            await anyio_comm.connect(f"tcp://127.0.0.1:{port}", handshake_timeout=0.2)
