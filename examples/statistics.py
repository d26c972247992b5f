"""Statistics: what each connection moved, and what the listener saw.

An echo server keeps the statistics of each connection as its handler ends; three
clients send ten messages each, of growing sizes. The program renders a table of the
connections, then the listener's figures. ``anyio-comm serve --stats SECONDS`` prints
the same figures live.

    python -m examples.statistics                  # asyncio
    python -m examples.statistics --backend trio
"""

from __future__ import annotations

import argparse

import anyio

import anyio_comm

SIZES = {"small": 100, "medium": 10_000, "large": 1_000_000}


def render(rows: dict[str, anyio_comm.CommStatistics]) -> str:
    """A table of connections' statistics, one row each."""
    lines = [f"{'peer':<8} {'messages in/out':>16} {'bytes in':>10} {'largest':>10} {'waits':>6}"]
    for name, stats in rows.items():
        lines.append(
            f"{name:<8} {stats.messages_received:>7}/{stats.messages_sent:<8}"
            f" {stats.bytes_received:>10,} {stats.largest_message_received:>10,}"
            f" {stats.send_waits + stats.budget_waits:>6}"
        )
    return "\n".join(lines)


async def main() -> None:
    ended: dict[str, anyio_comm.CommStatistics] = {}
    all_ended = anyio.Event()

    async def echo(comm: anyio_comm.Comm) -> None:
        name = await comm.receive()  # the client says who it is
        try:
            async for message in comm:
                await comm.send(message)
        finally:
            ended[name] = comm.statistics()  # readable after the comm closed too
            if len(ended) == len(SIZES):
                all_ended.set()

    async def client(address: str, name: str) -> None:
        async with await anyio_comm.connect(address, timeout=10) as comm:
            await comm.send(name)
            for _ in range(10):
                await comm.send(b"x" * SIZES[name])
                await comm.receive()

    with anyio.fail_after(30):
        async with anyio_comm.listen("tcp://127.0.0.1:0", echo) as listener:
            async with anyio.create_task_group() as tg:
                for name in SIZES:
                    tg.start_soon(client, listener.address, name)
            await all_ended.wait()  # (the handlers see the clients' ends)
            seen = listener.statistics()
    print(render({name: ended[name] for name in SIZES}))
    print(
        f"listener: {seen.accepted} accepted, {seen.active} open,"
        f" handlers {dict(sorted(seen.handlers.items()))}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="anyio-comm statistics example")
    parser.add_argument("--backend", choices=["asyncio", "uvloop", "trio"], default="asyncio")
    backend = parser.parse_args().backend
    if backend == "uvloop":
        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    else:
        anyio.run(main, backend=backend)
