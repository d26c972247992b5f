"""``python -m benchmarks.profile_small``: the round-trip mode runs anyio-comm over TCP and
over TLS on every backend (what it measures, never how fast), and refuses what it cannot
measure."""

from __future__ import annotations

import pytest
from anyio.streams.tls import TLSAttribute

import anyio_comm
from anyio_comm.bench import BACKENDS
from benchmarks import profile_small


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("tls", [None, "1.2", "1.3"])
def test_round_trips_run_over_tcp_and_tls(
    backend: str, tls: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    if backend == "uvloop":
        pytest.importorskip("uvloop")
    if backend == "trio":
        pytest.importorskip("trio")
    if tls:
        pytest.importorskip("trustme")
    argv = ["--backend", backend, "--mode", "roundtrip", "--count", "40", "--repeat", "1"]
    argv += ["--warmup", "5", "--concurrency", "2", *(("--tls", tls) if tls else ())]
    assert profile_small.main(argv) == 0
    out = capsys.readouterr().out
    assert "CPU us per round trip (anyio-comm, both ends, one process)" in out


async def test_tls_round_trips_go_over_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``tls`` the comms are ``tls://`` ones, of that TLS version."""
    seen: list[tuple[str, object]] = []
    connect = anyio_comm.connect

    async def recording_connect(address: str, **kwargs: object) -> anyio_comm.Comm:
        comm = await connect(address, **kwargs)  # type: ignore[arg-type]
        seen.append((address, comm.extra(TLSAttribute.tls_version)))
        return comm

    monkeypatch.setattr(anyio_comm, "connect", recording_connect)
    await profile_small._roundtrips(100, 4, 0, 2, "1.2")
    assert [(a.split(":")[0], v) for a, v in seen] == [("tls", "TLSv1.2")] * 2


def test_tls_is_for_anyio_comm_only() -> None:
    with pytest.raises(SystemExit, match="--tls measures anyio-comm"):
        profile_small.roundtrip("asyncio", 100, 10, 1, "raw", 0, 1, "1.3")
