"""Address strings: ``tcp://host:port``, ``tls://host:port``, ``unix:///path``, ``inproc://name``."""

from __future__ import annotations

import ipaddress
import socket
import ssl
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "Address",
    "check_connectable",
    "check_tls_options",
    "format_socket_address",
    "parse_address",
    "with_address",
]

SCHEMES: Final = ("tcp", "tls", "unix", "inproc")


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed address.

    Attributes:
        scheme: ``"tcp"``, ``"tls"``, ``"unix"`` or ``"inproc"``.
        host: TCP/TLS host (without IPv6 brackets), else ``""``. Empty in a
            TCP/TLS address to listen on every interface (``tcp://:8786``).
        port: TCP/TLS port, else 0.
        path: Unix socket path or inproc name, else ``""``.
    """

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""

    def __str__(self) -> str:
        if self.scheme in ("tcp", "tls"):
            return format_tcp(self.host, self.port, self.scheme)
        return f"{self.scheme}://{self.path}"


def format_tcp(host: str, port: int, scheme: str = "tcp") -> str:
    """Format a TCP (or TLS) address, bracketing IPv6 hosts."""
    if ":" in host:
        return f"{scheme}://[{host}]:{port}"
    return f"{scheme}://{host}:{port}"


def parse_address(address: str) -> Address:
    """Parse an address string.

    A ``tcp://`` or ``tls://`` address may leave the host empty
    (``tcp://:8786``): every interface, for a listener (see
    :func:`check_connectable`).

    Raises:
        ValueError: unknown scheme or malformed address (the message names
            the address).
        TypeError: ``address`` is not a string.
    """
    if not isinstance(address, str):
        raise TypeError(f"address must be a str, not {type(address).__name__}")
    scheme, sep, rest = address.partition("://")
    if not sep:
        raise ValueError(
            f"malformed address {address!r}: expected scheme://..., one of "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    if scheme not in SCHEMES:
        raise ValueError(
            f"unknown scheme {scheme!r} in address {address!r}; supported: "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    if scheme == "unix":
        if not rest or "\x00" in rest:
            raise ValueError(f"malformed address {address!r}: expected unix:///path")
        return Address("unix", path=rest)
    if scheme == "inproc":
        if "\x00" in rest:
            raise ValueError(f"malformed address {address!r}")
        return Address("inproc", path=rest)
    # tcp, tls
    if rest.startswith("["):
        host, bracket, port_text = rest[1:].partition("]")
        if not bracket or not port_text.startswith(":"):
            raise ValueError(f"malformed address {address!r}: expected tcp://[ipv6]:port")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(
                f"malformed address {address!r}: {host!r} is not an IPv6 address"
            ) from None
        port_text = port_text[1:]
    else:
        host, colon, port_text = rest.rpartition(":")
        if not colon:
            raise ValueError(f"malformed address {address!r}: expected {scheme}://host:port")
        if ":" in host:
            raise ValueError(
                f"malformed address {address!r}: IPv6 hosts need brackets, tcp://[::1]:port"
            )
    if any(c in host for c in "/?#@ "):
        raise ValueError(f"malformed address {address!r}: bad host {host!r}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"malformed address {address!r}: bad port {port_text!r}")
    return Address(scheme, host=host, port=int(port_text))


def check_connectable(address: Address) -> None:
    """Check that ``address`` names one peer to connect to.

    Raises:
        ValueError: a ``tcp://`` or ``tls://`` address without a host (every
            interface: only a listener can use that).
    """
    if address.scheme in ("tcp", "tls") and not address.host:
        raise ValueError(
            f"malformed address {str(address)!r}: no host to connect to (an empty "
            "host means every interface, for listening only)"
        )


def check_tls_options(address: Address, ssl_context: ssl.SSLContext | None) -> None:
    """Check that ``ssl_context`` is given exactly for ``tls://`` addresses.

    Raises:
        ValueError: a ``tls://`` address without ``ssl_context`` (never falls
            back to plaintext), or an ``ssl_context`` for another scheme.
        TypeError: ``ssl_context`` is not an ``ssl.SSLContext``.
    """
    if address.scheme == "tls":
        if ssl_context is None:
            raise ValueError(f"address {str(address)!r} is tls:// but no ssl_context was given")
        if not isinstance(ssl_context, ssl.SSLContext):
            raise TypeError(
                f"ssl_context must be an ssl.SSLContext, not {type(ssl_context).__name__}"
            )
    elif ssl_context is not None:
        raise ValueError(f"ssl_context was given for {str(address)!r}; TLS needs a tls:// address")


def with_address(exc: OSError, doing: str) -> OSError:
    """The same error, its message ending in what we were doing with which address
    (``doing``: ``"listening on unix:///run/app.sock"``), for the messages the
    system gives, which name none ("Address already in use", "AF_UNIX path too
    long"). Its class and ``errno`` (``strerror``: the system's text) stay; an
    error without an ``errno`` stays one.
    """
    if exc.errno is None:
        clear = type(exc)(f"{exc} ({doing})")
    else:
        clear = type(exc)(exc.errno, f"{exc.strerror} ({doing})")
    return clear.with_traceback(exc.__traceback__)


def format_socket_address(family: int, address: Any, scheme: str = "tcp") -> str:
    """Format a ``getsockname()`` / ``getpeername()`` result as an address string."""
    if family in (socket.AF_INET, socket.AF_INET6):
        return format_tcp(address[0], address[1], scheme)
    if isinstance(address, bytes):
        address = address.decode(errors="surrogateescape")
    return f"unix://{address}"
