"""A server as one task among others in a task group.

``await tg.start(anyio_comm.serve, address, handler)`` returns the ``Listener`` once it
is bound; clients then run in the same task group. A handler that raises is logged at
ERROR on the ``anyio_comm`` logger and only its connection is closed, telling the client
why (``PeerClosedError`` with the exception's class name and message): the listener
keeps serving. Cancelling the task group stops everything: the listener, every handler
(each connection is closed) and the clients still running.
"""

from __future__ import annotations

import logging

import anyio

import anyio_comm


async def handler(comm: anyio_comm.Comm) -> None:
    """Request/reply: answer each request until the client closes."""
    async for request in comm:
        if request["op"] == "fail":
            raise RuntimeError("bug in the handler")  # logged; only this comm is closed
        await comm.send({"id": request["id"], "square": request["x"] ** 2})


async def client(address: str, n: int) -> None:
    async with await anyio_comm.connect(address, timeout=10) as comm:
        await comm.send({"op": "square", "id": n, "x": n})
        reply = await comm.receive()
        print(f"client {n}: {n}**2 = {reply['square']}")


async def idle_client(address: str) -> None:
    """A long-lived connection, cancelled (and closed) with the task group."""
    async with await anyio_comm.connect(address, timeout=10) as comm:
        await comm.receive()  # the server never sends: waits until cancelled


async def main() -> None:
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            listener = await tg.start(anyio_comm.serve, "tcp://127.0.0.1:0", handler)
            print(f"serving on {listener.address}")
            tg.start_soon(idle_client, listener.address)
            async with anyio.create_task_group() as clients:
                for n in range(1, 4):
                    clients.start_soon(client, listener.address, n)

            async with await anyio_comm.connect(listener.address, timeout=10) as comm:
                await comm.send({"op": "fail"})
                try:
                    await comm.receive()
                except anyio_comm.PeerClosedError as exc:
                    print(f"the server closed the failing request's connection: {exc.reason}")
            await client(listener.address, 4)  # the listener is still serving

            tg.cancel_scope.cancel()  # stops serve, its handlers and idle_client
    print("task group cancelled: listener, handlers and connections are all closed")


if __name__ == "__main__":
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    anyio.run(main)
