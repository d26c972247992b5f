"""The public surface: __all__ complete, concrete classes final, docstrings present."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
import traceback
import typing

import anyio
import pytest

import anyio_comm
import anyio_comm.bench
import anyio_comm.rpc
import anyio_comm.testing

MODULES = [anyio_comm, anyio_comm.testing, anyio_comm.rpc, anyio_comm.bench]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_all_is_complete_and_sorted(module: object) -> None:
    public = {name for name in vars(module) if not name.startswith("_")}
    public -= {"annotations"}  # from __future__
    exported = set(module.__all__)  # type: ignore[attr-defined]
    assert public - {"testing", "dask", "rpc", "bench"} <= exported  # submodules, once imported
    assert all(hasattr(module, name) for name in exported)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_public_objects_have_docstrings(module: object) -> None:
    for name in module.__all__:  # type: ignore[attr-defined]
        obj = getattr(module, name)
        if hasattr(obj, "__origin__"):  # a type alias such as Allocator
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), name
            # mypyc gives a class it compiles without its docstring this one instead
            assert "mypyc filler" not in inspect.getdoc(obj), name


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


def exported_exceptions() -> list[tuple[str, type[BaseException]]]:
    """``(public module, class)`` for every exception class the package exports."""
    return [
        (module.__name__, obj)
        for module in MODULES
        for obj in (getattr(module, name) for name in module.__all__)
        if inspect.isclass(obj) and issubclass(obj, BaseException)
    ]


def example(cls: type[BaseException]) -> BaseException:
    """An instance of ``cls`` with its attributes set."""
    if issubclass(cls, anyio_comm.rpc.RPCError):
        return cls("add", "ValueError", "bad number")
    if issubclass(cls, anyio_comm.PeerClosed):
        return cls(anyio_comm.CloseReason(anyio_comm.CloseCode.IDLE_TIMEOUT, "idle", "quiet"))
    if cls is anyio_comm.RemoteProtocolError:
        return cls("bad header", rule="max_frames")
    return cls("what went wrong")


def test_exported_exceptions_name_their_public_module() -> None:
    """``anyio_comm.SerializationError``, not ``anyio_comm._sansio.errors.SerializationError``:
    in tracebacks, reprs of the class and the docs; the name leads back to the class."""
    exceptions = exported_exceptions()
    assert len(exceptions) == 21  # 11 in anyio_comm, 9 in anyio_comm.rpc, 1 in anyio_comm.bench
    for module, cls in exceptions:
        assert cls.__module__ == module, cls
        assert getattr(sys.modules[module], cls.__qualname__) is cls
        assert repr(cls) == f"<class '{module}.{cls.__qualname__}'>"
        typing.get_type_hints(cls)  # its annotations resolve where it says it lives
    try:
        raise anyio_comm.SerializationError("cannot serialize object of type 'set'")
    except anyio_comm.SerializationError:
        text = traceback.format_exc()
    assert text.endswith(
        "\nanyio_comm.SerializationError: cannot serialize object of type 'set'\n"
    ), text


@pytest.mark.parametrize(
    ("module", "cls"), exported_exceptions(), ids=lambda v: getattr(v, "__name__", None)
)
def test_exported_exceptions_pickle(module: str, cls: type[BaseException]) -> None:
    """The class and its instances round-trip (pickle looks up module.qualname)."""
    assert pickle.loads(pickle.dumps(cls)) is cls
    if cls is anyio_comm.ProtocolError:
        return  # abstract
    error = example(cls)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert copy.args == error.args and str(copy) == str(error)
    assert vars(copy) == vars(error)  # rule, reason, method, remote_type, ...


def test_exported_exceptions_unpickle_in_a_fresh_interpreter() -> None:
    """Where nothing has imported them yet: the package imports them on first use."""
    concrete = [cls for _, cls in exported_exceptions() if cls is not anyio_comm.ProtocolError]
    data = pickle.dumps([example(cls) for cls in concrete])
    code = (
        "import pickle, sys\n"
        f"errors = pickle.loads({data!r})\n"
        "print(' '.join(f'{type(e).__module__}.{type(e).__qualname__}' for e in errors))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [f"{cls.__module__}.{cls.__qualname__}" for cls in concrete]
