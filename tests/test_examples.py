"""The examples in ``examples/`` run on every backend and print what they did.

The guides include these files verbatim, so the code they show is the code tested here.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from examples import (
    echo,
    rpc,
    rpc_service,
    statistics,
    structured_server,
    testing_with_comm_pair,
    tls_echo,
    zero_copy,
)

from . import certs

ROOT = Path(__file__).parents[1]


async def test_echo(capsys: pytest.CaptureFixture[str]) -> None:
    await echo.main()
    out = capsys.readouterr().out
    assert "listening on tcp://127.0.0.1:" in out
    assert "got back a memoryview of 10,000,000 bytes, equal: True" in out
    assert out.endswith("listener closed: its handlers and connections are gone\n")


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
async def test_tls_echo(capsys: pytest.CaptureFixture[str], mutual: bool) -> None:
    server_context = certs.server_context(require_client_cert=mutual)
    client_context = certs.client_context(with_cert=mutual)
    await tls_echo.main(server_context, client_context)
    out = capsys.readouterr().out
    assert "listening on tls://127.0.0.1:" in out
    assert "negotiated TLSv1." in out
    assert "server certificate: organizationName=trustme" in out
    assert "IP Address:127.0.0.1" in out
    assert "echo: 'hello'" in out
    seen = out.split("client certificate, as the server saw it: ")[1]
    if mutual:
        assert "email:client@example.org" in seen
    else:
        assert seen == "none\n"


async def test_structured_server(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="anyio_comm"):
        await structured_server.main()
    out = capsys.readouterr().out
    for n in range(1, 5):
        assert f"client {n}: {n}**2 = {n * n}\n" in out
    assert (
        "the server closed the failing request's connection: "
        "HANDLER_ERROR (RuntimeError: bug in the handler)\n"
    ) in out
    assert out.endswith(
        "task group cancelled: listener, handlers and connections are all closed\n"
    )
    (error,) = [
        r for r in caplog.records if r.name == "anyio_comm" and r.levelno >= logging.WARNING
    ]
    assert error.levelno == logging.ERROR
    assert error.name == "anyio_comm"
    assert error.getMessage().startswith("connection handler for tcp://127.0.0.1:")
    assert error.exc_info is not None
    assert isinstance(error.exc_info[1], RuntimeError)


async def test_zero_copy(capsys: pytest.CaptureFixture[str]) -> None:
    await zero_copy.main()
    out = capsys.readouterr().out
    assert "100-byte value: bytes, 50 MB value: memoryview\n" in out
    assert "over its own bytearray of 50,000,000 bytes" in out
    # the body frame and the out-of-band frame, then three frames
    assert "message: 2 buffers allocated" in out
    assert "frames: [6, 1000000, 1000] bytes, first: b'header'" in out
    assert "total: 5 buffers allocated" in out


async def test_testing_with_comm_pair(capsys: pytest.CaptureFixture[str]) -> None:
    await testing_with_comm_pair.main()
    out = capsys.readouterr().out
    assert "stats request -> {'status': 'OK', 'range': [1, 3], 'n': 3}" in out
    assert "handle_request passed" in out


async def test_rpc(capsys: pytest.CaptureFixture[str]) -> None:
    await rpc.main()
    out = capsys.readouterr().out
    assert "add(1, 2) = 3\n" in out
    assert "nbytes(8 MB) = 8,000,000\n" in out
    assert "error reply: divide failed on the server: KeyError('divide')" in out


async def test_rpc_service(capsys: pytest.CaptureFixture[str]) -> None:
    await rpc_service.main()
    out = capsys.readouterr().out
    assert "serving on tcp://127.0.0.1:" in out
    assert "connections to the server: 1\n" in out
    assert "pears: 55\n" in out
    assert "remote error: KeyError: 'plum'\n" in out
    assert "audit() was cancelled on the server when the deadline passed\n" in out
    assert "plums received: 12\n" in out
    assert "  apple: 3\n  pear: 55\n  plum: 12\n" in out
    assert "without a name: PermissionError: say who you are\n" in out
    assert "served: {'call': 13, 'notification': 1, 'stream': 1, 'upload': 1}\n" in out
    assert out.endswith("log: ['12 from orchard', 'restocked pears']\n")


async def test_statistics(capsys: pytest.CaptureFixture[str]) -> None:
    await statistics.main()
    out = capsys.readouterr().out
    # per message: a 12-byte header and msgpack's 2-, 3- or 5-byte bin header; the
    # large one goes out-of-band (a 6-byte body beside its frame); the 36-byte
    # preamble and the client's name message (18 and 19 bytes) once
    assert out == (
        "peer      messages in/out   bytes in    largest  waits\n"
        "small         11/10            1,194        102      0\n"
        "medium        11/10          100,205     10,003      0\n"
        "large         11/10       10,000,314  1,000,006      0\n"
        "listener: 3 accepted, 0 open, handlers {'returned': 3}\n"
    )


SCRIPT_OUTPUT = {
    "echo": "equal: True",
    "tls_echo": "email:client@example.org",  # the mutual TLS run
    "structured_server": "client 4: 4**2 = 16",
    "zero_copy": "total: 5 buffers allocated",
    "testing_with_comm_pair": "handle_request passed",
    "rpc": "add(1, 2) = 3",
    "rpc_service": "pears: 55",
    "statistics": "listener: 3 accepted",
}


@pytest.mark.parametrize(("module", "expected"), SCRIPT_OUTPUT.items(), ids=SCRIPT_OUTPUT)
def test_example_runs_as_a_script(module: str, expected: str) -> None:
    """``python -m examples.NAME`` works, including its ``__main__`` block."""
    result = subprocess.run(
        [sys.executable, "-m", f"examples.{module}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout
