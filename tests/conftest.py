"""Every async test runs on asyncio, asyncio+uvloop and trio (``-k trio`` selects one)."""

from __future__ import annotations

import importlib.util
import socket
import sys

import hypothesis  # noqa: F401  (imported early: a lazy import at session end trips CPython 3.11.7)
import pytest

_HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None
_HAVE_TRIO = importlib.util.find_spec("trio") is not None


def needs(package: str, value: object, **kwargs: object) -> object:
    """``value`` as a parameter that is skipped when ``package`` (uvloop, trio) is missing."""
    have = {"uvloop": _HAVE_UVLOOP, "trio": _HAVE_TRIO}[package]
    mark = pytest.mark.skipif(not have, reason=f"{package} is not installed")
    return pytest.param(value, marks=mark, **kwargs)  # type: ignore[arg-type]


def _has_ipv6() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


HAVE_IPV6 = _has_ipv6()


@pytest.fixture(scope="session", autouse=True)
def _tls_material() -> None:
    """Generate the test CA and certificates once, before any event loop runs."""
    from . import certs

    certs.server_cert()
    certs.client_cert()
    certs.expired_server_cert()


HAVE_UNIX = hasattr(socket, "AF_UNIX") and sys.platform != "win32"


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        needs("uvloop", ("asyncio", {"use_uvloop": True}), id="asyncio+uvloop"),
        needs("trio", ("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]
