"""dask distributed's comm layer, as dask's own comm benchmarks use it.

``distributed.comm.listen`` / ``connect`` on ``tcp://`` (or ``tls://`` with
``ssl_context``), both with ``deserialize=False``: the client writes
``{"data": [to_serialize(frame), ...]}``, the server reads ``Serialized``
objects and writes the same message back, so frames are never deserialized.
Asyncio only (tornado IOStreams on the running loop).
"""

# ruff: noqa: ARG001  (every system takes the same arguments; some need fewer)

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from benchmarks.systems.framing import Checker, make_frames

if TYPE_CHECKING:
    import ssl
    from collections.abc import Awaitable, Callable


def _scheme(ssl_context: ssl.SSLContext | None) -> str:
    return "tcp" if ssl_context is None else "tls"


def _tls_args(ssl_context: ssl.SSLContext | None) -> dict[str, Any]:
    return {} if ssl_context is None else {"ssl_context": ssl_context}


def run_server(case: Any, ssl_context: ssl.SSLContext | None, counter: Any, ready: Any) -> None:
    """Echo every message back until the process ends."""
    import asyncio

    from distributed.comm import CommClosedError, listen

    async def echo(comm: Any) -> None:
        with contextlib.suppress(CommClosedError):
            while True:
                message = await comm.read()
                await comm.write(message)
                counter.n += 1

    async def main() -> None:
        listener = await listen(
            f"{_scheme(ssl_context)}://127.0.0.1:0",
            echo,
            deserialize=False,
            **_tls_args(ssl_context),
        )
        await listener.start()
        ready(listener.contact_address.replace("tls://", "tcp://"))
        await asyncio.get_running_loop().create_future()  # forever

    asyncio.run(main())


async def open_client(
    stack: contextlib.AsyncExitStack, address: str, case: Any, ssl_context: ssl.SSLContext | None
) -> Callable[[], Awaitable[None]]:
    """One dask comm; round trips write the message and read the echo."""
    from distributed.comm import connect
    from distributed.protocol import to_serialize

    host_port = address.removeprefix("tcp://")
    extra = _tls_args(ssl_context)
    if ssl_context is not None:
        extra["server_hostname"] = host_port.rpartition(":")[0]
    comm = await connect(
        f"{_scheme(ssl_context)}://{host_port}", timeout=30, deserialize=False, **extra
    )
    stack.push_async_callback(comm.close)
    message = {"data": [to_serialize(frame) for frame in make_frames(case.size, case.frames)]}
    checker = Checker(case.size, case.frames)

    async def roundtrip() -> None:
        await comm.write(message)
        reply = await comm.read()
        if checker.due():
            checker.check(
                [sum(memoryview(f).nbytes for f in item.frames) for item in reply["data"]]
            )

    return roundtrip
