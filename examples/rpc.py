"""Request/reply RPC in the style of dask's comm handlers.

Each request is a dict naming an operation, ``{"op": "add", "x": 1, "y": 2}``; the
server looks the operation up in a table of handlers, calls it with the other keys and
sends back one reply per request. One connection carries any number of requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

import anyio_comm

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


async def add(x: int, y: int) -> int:
    return x + y


async def nbytes(data: bytes | memoryview) -> int:
    return len(data)  # a large payload arrives as a memoryview: no copy was made


HANDLERS: dict[str, Callable[..., Awaitable[Any]]] = {"add": add, "nbytes": nbytes}


async def handle_comm(comm: anyio_comm.Comm) -> None:
    """Server side: answer requests until the client closes."""
    async for request in comm:
        op = request.pop("op")
        try:
            result = await HANDLERS[op](**request)
        except Exception as exc:
            await comm.send({"status": "error", "exception": repr(exc)})
        else:
            await comm.send({"status": "OK", "result": result})


async def rpc(comm: anyio_comm.Comm, op: str, **kwargs: Any) -> Any:
    """Client side: send one request, return its result or raise its error."""
    await comm.send({"op": op, **kwargs})
    reply = await comm.receive()
    if reply["status"] != "OK":
        raise RuntimeError(f"{op} failed on the server: {reply['exception']}")
    return reply["result"]


async def main() -> None:
    async with anyio_comm.listen("tcp://127.0.0.1:0", handle_comm) as listener:
        print(f"serving on {listener.address}")
        async with await anyio_comm.connect(listener.address, timeout=10) as comm:
            with anyio.fail_after(10):
                print(f"add(1, 2) = {await rpc(comm, 'add', x=1, y=2)}")
                print(f"nbytes(8 MB) = {await rpc(comm, 'nbytes', data=b'x' * 8_000_000):,}")
                try:
                    await rpc(comm, "divide", x=1, y=0)
                except RuntimeError as exc:
                    print(f"error reply: {exc}")


if __name__ == "__main__":
    anyio.run(main)
