"""TLS for benchmarks: what a process needs to build its SSL context (picklable, so that it
can be handed to a child process), and test certificates made with trustme."""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Iterator

#: the TLS versions a benchmark can pin its contexts to
TLS_VERSIONS: Final = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


def _pin_version(context: ssl.SSLContext, version: str | None) -> ssl.SSLContext:
    if version is not None:
        context.minimum_version = context.maximum_version = TLS_VERSIONS[version]
    return context


@dataclass(frozen=True)
class ClientTLS:
    """What a client process needs to build its SSL context (picklable)."""

    cadata: str | None = None  # PEM of the CA to trust (local run: the trustme CA)
    cafile: str | None = None  # file of CAs to trust; neither: the system's default CAs
    certfile: str | None = None  # client certificate, for servers that require one
    keyfile: str | None = None
    server_hostname: str | None = None
    version: str | None = None  # a key of TLS_VERSIONS: exactly that version; None: any

    def context(self) -> ssl.SSLContext:
        """A client SSL context that verifies the server."""
        context = ssl.create_default_context(cafile=self.cafile, cadata=self.cadata)
        if self.certfile is not None:
            context.load_cert_chain(self.certfile, self.keyfile)
        return _pin_version(context, self.version)


@dataclass(frozen=True)
class ServerTLS:
    """What the server needs to build its SSL context (picklable)."""

    certfile: str
    keyfile: str | None = None
    cafile: str | None = None  # given: client certificates are required and checked
    version: str | None = None  # a key of TLS_VERSIONS: exactly that version; None: any

    def context(self) -> ssl.SSLContext:
        """The server SSL context."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.certfile, self.keyfile)
        if self.cafile is not None:
            context.load_verify_locations(self.cafile)
            context.verify_mode = ssl.CERT_REQUIRED
        return _pin_version(context, self.version)


@dataclass(frozen=True)
class TLSFiles:
    """Test certificates made with trustme by the parent process (see :func:`certificates`)."""

    ca_pem: bytes  # the CA certificate the client trusts
    server_pem: str  # path of the server's private key and certificate chain

    def server(self, version: str | None = None) -> ServerTLS:
        """The server's side: our certificate (``version``: exactly that TLS version)."""
        return ServerTLS(self.server_pem, version=version)

    def client(self, version: str | None = None) -> ClientTLS:
        """The client's side: trusts only our CA (``version``: exactly that TLS version)."""
        return ClientTLS(cadata=self.ca_pem.decode("ascii"), version=version)


def make_certificates(directory: str) -> TLSFiles:
    """A CA and a server certificate for 127.0.0.1 and localhost, in ``directory``."""
    import trustme  # only needed for TLS runs

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    server_pem = os.path.join(directory, "server.pem")
    with open(server_pem, "wb") as fh:
        fh.write(cert.private_key_and_cert_chain_pem.bytes())
    return TLSFiles(ca_pem=ca.cert_pem.bytes(), server_pem=server_pem)


@contextlib.contextmanager
def certificates(prefix: str | None) -> Iterator[TLSFiles | None]:
    """Test certificates in a temporary directory named ``prefix...``, removed afterwards
    (None: no certificates)."""
    if prefix is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as directory:
        yield make_certificates(directory)


def server_context(files: TLSFiles | None, version: str | None) -> ssl.SSLContext | None:
    """The server's SSL context: our certificate, exactly TLS ``version``; None for plain TCP
    (no files or no version)."""
    if files is None or version is None:
        return None
    return files.server(version).context()


def client_context(files: TLSFiles | None, version: str | None) -> ssl.SSLContext | None:
    """The client's SSL context: trusts only our CA, exactly TLS ``version``; None for plain
    TCP (no files or no version)."""
    if files is None or version is None:
        return None
    return files.client(version).context()
