"""The public surface: __all__ complete, concrete classes final, docstrings present."""

from __future__ import annotations

import inspect

import anyio
import pytest

import anyio_comm
import anyio_comm.rpc
import anyio_comm.testing

MODULES = [anyio_comm, anyio_comm.testing, anyio_comm.rpc]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_all_is_complete_and_sorted(module: object) -> None:
    public = {name for name in vars(module) if not name.startswith("_")}
    public -= {"annotations"}  # from __future__
    exported = set(module.__all__)  # type: ignore[attr-defined]
    assert public - {"testing", "dask", "rpc"} <= exported  # submodules, once imported
    assert all(hasattr(module, name) for name in exported)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_public_objects_have_docstrings(module: object) -> None:
    for name in module.__all__:  # type: ignore[attr-defined]
        obj = getattr(module, name)
        if hasattr(obj, "__origin__"):  # a type alias such as Allocator
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), name


def test_concrete_classes_are_final() -> None:
    rpc = anyio_comm.rpc
    for cls in (
        anyio_comm.Comm,
        anyio_comm.Listener,
        rpc.Client,
        rpc.Pool,
        rpc.Server,
        rpc.Stream,
    ):
        assert getattr(cls, "__final__", False), cls  # @typing.final, for type checkers
    # exceptions are meant to be subclassed only through the documented tree
    assert issubclass(anyio_comm.RemoteProtocolError, anyio_comm.ProtocolError)
    assert issubclass(anyio_comm.LocalProtocolError, anyio_comm.ProtocolError)
    assert issubclass(anyio_comm.ProtocolError, anyio_comm.CommError)
    assert issubclass(anyio_comm.SerializationError, TypeError)
    for cls in (anyio_comm.MessageTimeoutError, anyio_comm.ReceiveBudgetError):
        assert issubclass(cls, anyio_comm.CommError)
        assert issubclass(cls, anyio.BrokenResourceError)
    assert issubclass(anyio_comm.MessageTimeoutError, TimeoutError)
    with pytest.raises(TypeError, match="abstract"):
        anyio_comm.ProtocolError("x")


def test_async_public_functions_document_what_they_raise() -> None:
    for func in (anyio_comm.connect, anyio_comm.from_stream, anyio_comm.listen):
        assert "Raises:" in (func.__doc__ or ""), func
    for method in ("send", "receive", "send_frames", "receive_frames", "send_eof"):
        assert "Raises:" in (getattr(anyio_comm.Comm, method).__doc__ or ""), method
    rpc = anyio_comm.rpc
    for func in (rpc.connect, rpc.serve, rpc.Client.call, rpc.Client.notify, rpc.Client.stream):
        assert "Raises:" in (func.__doc__ or ""), func
    assert "Raises:" in (rpc.Pool.client.__doc__ or "")
    for cls in (rpc.RemoteError, rpc.MethodNotFoundError, rpc.OverloadedError):
        assert issubclass(cls, rpc.RPCError) and issubclass(cls, anyio_comm.CommError)
    assert issubclass(rpc.InvalidArgumentsError, TypeError)
    assert issubclass(rpc.DeadlineExceededError, TimeoutError)
