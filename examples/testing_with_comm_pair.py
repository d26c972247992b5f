"""Testing your own protocol code with ``anyio_comm.testing.comm_pair()``.

``comm_pair()`` returns two connected comms that run the full codec (preamble,
framing, msgpack, out-of-band frames) over a bounded in-memory byte stream: no
sockets, and no object passed by reference, so a test sees exactly what a peer
would receive (a tuple comes back as a list, a large bytes value as a memoryview).
``handle_request`` is the code under test; ``main`` is the test body.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from anyio_comm.testing import comm_pair

if TYPE_CHECKING:
    from anyio_comm import Comm


async def handle_request(comm: Comm) -> None:
    """Code under test: answer ``{"op": "stats", "values": [...]}`` until the peer stops."""
    async for request in comm:
        if request.get("op") != "stats":
            await comm.send({"status": "error", "message": f"unknown op {request.get('op')!r}"})
            continue
        values = request["values"]
        await comm.send({"status": "OK", "range": (min(values), max(values)), "n": len(values)})


async def main() -> None:
    client, server = await comm_pair()
    async with client, server, anyio.create_task_group() as tg:
        tg.start_soon(handle_request, server)
        with anyio.fail_after(5):
            await client.send({"op": "stats", "values": [3, 1, 2]})
            reply = await client.receive()
            assert reply == {"status": "OK", "range": [1, 3], "n": 3}  # the tuple is a list
            print(f"stats request -> {reply}")

            await client.send({"op": "bogus"})
            reply = await client.receive()
            assert reply["status"] == "error"
            print(f"unknown op    -> {reply}")

            await client.send_eof()  # handle_request's `async for` ends cleanly
    print("handle_request passed: 2 requests answered, returned at end of stream")


if __name__ == "__main__":
    anyio.run(main)
