"""TLS and mutual TLS: a request/reply over ``tls://``.

``main`` takes the two SSL contexts, so the same code runs plain TLS (the client
verifies the server's certificate) and mutual TLS (the server also requires and
verifies a client certificate). Each side reports what it sees of the other through
``comm.extra(TLSAttribute...)``.
"""

from __future__ import annotations

import ssl
from typing import Any

import anyio
from anyio.streams.tls import TLSAttribute

import anyio_comm


def describe(certificate: dict[str, Any] | None) -> str:
    """Summarize a ``getpeercert()`` dict: its subject and subject alternative names."""
    if not certificate:
        return "none"
    subject = ", ".join(f"{key}={value}" for rdn in certificate["subject"] for key, value in rdn)
    names = ", ".join(f"{kind}:{name}" for kind, name in certificate["subjectAltName"])
    return f"{subject} [{names}]"


async def handler(comm: anyio_comm.Comm) -> None:
    """Reply with what the server knows about the client's certificate."""
    async for request in comm:
        client_certificate = comm.extra(TLSAttribute.peer_certificate)
        await comm.send({"echo": request, "client": describe(client_certificate)})


async def main(server_context: ssl.SSLContext, client_context: ssl.SSLContext) -> None:
    address = "tls://127.0.0.1:0"
    async with anyio_comm.listen(address, handler, ssl_context=server_context) as listener:
        print(f"listening on {listener.address}")
        comm = await anyio_comm.connect(listener.address, ssl_context=client_context, timeout=10)
        async with comm:
            print(f"negotiated {comm.extra(TLSAttribute.tls_version)}")
            server_certificate = comm.extra(TLSAttribute.peer_certificate)
            print(f"server certificate: {describe(server_certificate)}")
            with anyio.fail_after(10):
                await comm.send("hello")
                reply = await comm.receive()
            print(f"echo: {reply['echo']!r}")
            print(f"client certificate, as the server saw it: {reply['client']}")


if __name__ == "__main__":
    # trustme makes a throwaway CA in memory (pip install trustme). Real deployments
    # load files instead: server_context.load_cert_chain("server.pem", "server.key"),
    # ssl.create_default_context(cafile="ca.pem") for the client.
    import trustme

    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    print("-- TLS")
    anyio.run(main, server_context, client_context)

    # Mutual TLS: the server requires a client certificate signed by a CA it trusts
    # (server_context.load_verify_locations("ca.pem"), client_context.load_cert_chain(...)).
    server_context.verify_mode = ssl.CERT_REQUIRED
    ca.configure_trust(server_context)
    ca.issue_cert("client@example.org").configure_cert(client_context)
    print("-- mutual TLS")
    anyio.run(main, server_context, client_context)
