"""An RPC service with anyio_comm.rpc: a class of methods served over TCP, called
through a connection pool by many tasks at once, with deadlines that reach the
server, typed remote errors, an upload, a one-way notification and a streamed result, and
interceptors on both sides: the client's names itself in each call's metadata, the
server's refuses calls that do not and counts those it serves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from anyio_comm import rpc

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


class Inventory:
    """The server's methods: every public method can be called."""

    def __init__(self) -> None:
        self.stock: dict[str, int] = {"apple": 3, "pear": 0}
        self.log: list[str] = []
        self.abandoned = anyio.Event()

    async def count(self, item: str) -> int:
        return self.stock[item]  # an unknown item raises KeyError, sent back typed

    async def restock(self, item: str, amount: int) -> int:
        await anyio.sleep(0.01)  # some I/O
        self.stock[item] = self.stock.get(item, 0) + amount
        return self.stock[item]

    async def audit(self) -> None:
        try:
            await anyio.sleep(60)  # far longer than any caller waits
        finally:
            self.abandoned.set()  # cancelled on the server when the caller's deadline passed

    async def note(self, text: str) -> None:
        self.log.append(text)  # a notification: nothing is sent back

    async def receive_shipment(self, boxes: rpc.InputStream, supplier: str) -> int:
        # an upload: the caller sends the boxes one by one, as the server takes them
        count = 0
        async for item, amount in boxes:
            self.stock[item] = self.stock.get(item, 0) + amount
            count += amount
        self.log.append(f"{count} from {supplier}")
        return count

    async def items(self) -> AsyncIterator[tuple[str, int]]:
        for item, amount in sorted(self.stock.items()):
            yield item, amount  # streamed, at the pace the caller takes them


class CallCounter:
    """A server interceptor: refuses calls from clients that do not say who they
    are, and counts the others by kind ("call", "stream", "notification")."""

    def __init__(self) -> None:
        self.served: dict[str, int] = {}

    async def __call__(self, call: rpc.CallContext, proceed: rpc.Proceed) -> Any:
        if "client" not in call.metadata:
            raise PermissionError("say who you are")  # the method does not run
        self.served[call.kind] = self.served.get(call.kind, 0) + 1
        return await proceed()


async def name_the_client(call: rpc.OutgoingCall, proceed: rpc.Proceed) -> Any:
    """A client interceptor: every call, stream and notification carries the
    client's name."""
    call.metadata["client"] = "stock-keeper"
    return await proceed()


async def main() -> None:
    inventory = Inventory()
    counter = CallCounter()
    async with rpc.serve(
        "tcp://127.0.0.1:0", inventory, max_calls_per_connection=50, interceptors=[counter]
    ) as server:
        print(f"serving on {server.address}")
        async with rpc.connect(server.address) as anonymous:
            try:
                await anonymous.call("count", "pear")
            except rpc.RemoteError as exc:
                print(f"without a name: {exc.remote_type}: {exc.remote_message}")
        async with rpc.Pool(max_per_address=2, interceptors=[name_the_client]) as pool:
            # many tasks share the pool's connections; their calls are multiplexed
            async def restock(n: int) -> None:
                async with pool.client(server.address) as remote:
                    await remote.call("restock", "pear", n)

            async with anyio.create_task_group() as tg:
                for n in range(1, 11):
                    tg.start_soon(restock, n)
            print(f"connections to the server: {pool.connections(server.address)}")

            async with pool.client(server.address) as remote:
                print(f"pears: {await remote.call('count', 'pear')}")

                try:
                    await remote.call("count", "plum")
                except rpc.RemoteError as exc:
                    print(f"remote error: {exc.remote_type}: {exc.remote_message}")

                with anyio.move_on_after(0.1):  # the deadline travels with the call
                    await remote.call("audit")
                with anyio.fail_after(5):
                    await inventory.abandoned.wait()
                print("audit() was cancelled on the server when the deadline passed")

                async with remote.upload("receive_shipment", "orchard") as shipment:
                    for _ in range(3):
                        await shipment.send(("plum", 4))
                    print(f"plums received: {await shipment.finish()}")

                await remote.notify("note", "restocked pears")
                async with remote.stream("items") as items:
                    async for item, amount in items:
                        print(f"  {item}: {amount}")
        print(f"served: {dict(sorted(counter.served.items()))}")
    print(f"log: {inventory.log}")


if __name__ == "__main__":
    anyio.run(main)
