"""Backend detection: trio in guest mode on an asyncio host is trio, not asyncio."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import anyio
import pytest

import anyio_comm
from anyio_comm._backend import current_backend

from .certs import client_context, server_context
from .conftest import needs
from .helpers import ADDRESS_TRANSPORTS, listen_address

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trio") is None, reason="trio is not installed"
)

HOSTS = ["asyncio", needs("uvloop", "uvloop")]


def run_as_guest(host: str, trio_main: Any) -> Any:
    """Run ``trio_main()`` with trio in guest mode on a ``host`` event loop; return its
    result (or raise its exception)."""
    import trio

    async def host_main() -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        trio.lowlevel.start_guest_run(
            trio_main,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=done.set_result,
            host_uses_signal_set_wakeup_fd=True,
        )
        outcome = await asyncio.wait_for(done, 30)
        return outcome.unwrap()

    if host == "uvloop":
        import uvloop

        return uvloop.run(host_main())
    return asyncio.run(host_main())


async def echo(comm: anyio_comm.Comm) -> None:
    async for message in comm:
        await comm.send(message)


@pytest.mark.parametrize("host", HOSTS)
def test_detects_trio_in_guest_mode(host: str) -> None:
    async def trio_main() -> str:
        return current_backend().name

    assert run_as_guest(host, trio_main) == "trio"


@pytest.mark.parametrize("kind", [*ADDRESS_TRANSPORTS, "tls1.3"])
@pytest.mark.parametrize("host", HOSTS)
def test_connect_and_listen_in_trio_guest_mode(host: str, kind: str) -> None:
    """Before the helper, any running asyncio loop meant asyncio: a trio guest's comm
    awaited asyncio futures and trio failed ("unrecognized yield message")."""

    async def trio_main() -> list[Any]:
        server_options: dict[str, Any] = {}
        client_options: dict[str, Any] = {}
        if kind == "tls1.3":
            server_options["ssl_context"] = server_context()
            client_options["ssl_context"] = client_context()
        replies = []
        async with listen_address(kind) as address:
            async with anyio_comm.listen(address, echo, **server_options) as listener:
                async with await anyio_comm.connect(
                    listener.address, timeout=10, **client_options
                ) as comm:
                    for i in range(20):
                        await comm.send({"i": i, "data": bytes(5000)})
                        replies.append(await comm.receive())
        return replies

    replies = run_as_guest(host, trio_main)
    assert [reply["i"] for reply in replies] == list(range(20))
    assert all(reply["data"] == bytes(5000) for reply in replies)


async def test_current_backend_names_the_running_loop(anyio_backend_name: str) -> None:
    backend = current_backend()
    assert backend.name == anyio_backend_name
    assert (backend.loop is None) == (anyio_backend_name == "trio")


def test_current_backend_outside_a_loop() -> None:
    with pytest.raises(RuntimeError, match="no async event loop"):
        current_backend()


def test_anyio_sees_the_same_backend() -> None:
    async def main() -> str:
        return current_backend().name

    assert anyio.run(main, backend="trio") == "trio"
    assert anyio.run(main) == "asyncio"
