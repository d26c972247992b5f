"""Quickstart: an echo server and a client in one program.

The listener runs ``echo(comm)`` for each connection. The client sends a dict whose
large bytes value travels out-of-band (never copied into the msgpack body) and comes
back as a zero-copy ``memoryview``. The same code runs on every AnyIO backend:

    python -m examples.echo                   # anyio.run(main)
    python -m examples.echo --backend trio    # anyio.run(main, backend="trio")
    python -m examples.echo --backend uvloop  # anyio.run(main, backend="asyncio",
                                              #           backend_options={"use_uvloop": True})
"""

from __future__ import annotations

import argparse

import anyio

import anyio_comm


async def echo(comm: anyio_comm.Comm) -> None:
    """Send every message back; the loop ends when the client closes."""
    async for message in comm:
        await comm.send(message)


async def main() -> None:
    async with anyio_comm.listen("tcp://127.0.0.1:0", echo) as listener:
        print(f"listening on {listener.address}")
        async with await anyio_comm.connect(listener.address, timeout=10) as comm:
            print(f"connected {comm.local_address} -> {comm.peer_address}")
            payload = b"x" * 10_000_000
            with anyio.fail_after(10):
                await comm.send({"op": "echo", "data": payload})
                reply = await comm.receive()
            data = reply["data"]
            print(
                f"sent {len(payload):,} bytes, got back a {type(data).__name__} "
                f"of {data.nbytes:,} bytes, equal: {data == payload}"
            )
    print("listener closed: its handlers and connections are gone")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="anyio-comm echo quickstart")
    parser.add_argument("--backend", choices=["asyncio", "uvloop", "trio"], default="asyncio")
    backend = parser.parse_args().backend
    if backend == "uvloop":
        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    else:
        anyio.run(main, backend=backend)
