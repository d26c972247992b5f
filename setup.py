"""The build's one option: ``ANYIO_COMM_MYPYC=1`` compiles the per-message path with mypyc.

Without it (the default) the wheel is pure Python. With it, the modules that
``anyio_comm/_build.py`` lists are built as C extensions next to their sources, which stay
in the wheel; the compiled wheel is for the CPython version and platform it was built on,
and building it needs a C compiler and that Python's headers. ``anyio-comm --version``
tells which form was imported.

This file is also the build backend (``pyproject.toml``): setuptools' own, but for the
requirements of a compiled wheel, which add ``MYPY``, so that an isolated build
(``pip install``, ``python -m build``) fetches it. A build without isolation uses the mypy
installed. Only a wheel is compiled: an sdist, the metadata, and an editable install
(refused) are not.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Any

#: the compiler: one release, so that a given source always compiles to the same code
MYPY = "mypy==2.4.1"
#: the setuptools commands that build what a wheel holds: the ones that compile
BUILD_COMMANDS = frozenset({"bdist_wheel", "build", "build_ext", "build_py", "install"})
#: the commands of an editable install, which a compiled build refuses
EDITABLE_COMMANDS = frozenset({"editable_wheel", "develop"})


def compiling() -> bool:
    """Whether ``ANYIO_COMM_MYPYC`` asks for the compiled form.

    Raises:
        SystemExit: its value is not 0, 1, true or false (in any case), or empty.
    """
    option = os.environ.get("ANYIO_COMM_MYPYC", "")
    if option.lower() not in ("", "0", "1", "false", "true"):
        raise SystemExit(f"ANYIO_COMM_MYPYC must be 0 or 1, not {option!r}")
    return option.lower() in ("1", "true")


def compiled_sources() -> list[str]:
    """The files of the modules compiled: ``anyio_comm/_build.py``'s ``COMPILABLE``, which
    the package reads at run time to tell which form was imported."""
    tree = ast.parse((Path(__file__).parent / "anyio_comm" / "_build.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "COMPILABLE":
            return [name.replace(".", "/") + ".py" for name in ast.literal_eval(node.value)]
    raise SystemExit("anyio_comm/_build.py has no COMPILABLE")


# -- the build backend (PEP 517) ----------------------------------------------------------


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    """setuptools' requirements, and ``MYPY`` for a compiled wheel."""
    from setuptools import build_meta

    requires: list[str] = build_meta.get_requires_for_build_wheel(config_settings)
    return [*requires, MYPY] if compiling() else requires


def __getattr__(name: str) -> Any:
    """The other hooks are setuptools' own."""
    from setuptools import build_meta

    return getattr(build_meta, name)


# -- setup.py, which setuptools runs ------------------------------------------------------


def main() -> None:
    compiled = compiling()  # (tests/test_build.py runs this much without setuptools)
    from setuptools import setup

    commands = {argument for argument in sys.argv[1:] if not argument.startswith("-")}
    if compiled and commands & EDITABLE_COMMANDS:
        raise SystemExit(
            "ANYIO_COMM_MYPYC=1 builds a wheel, not an editable install (the extensions "
            "would stay in the source tree and shadow its modules)"
        )
    if not (compiled and commands & BUILD_COMMANDS):
        setup()
        return
    try:
        from mypyc.build import mypycify
    except ImportError:
        raise SystemExit(f"ANYIO_COMM_MYPYC=1 needs {MYPY} to build with") from None
    # the build environment holds the compiler, not the package's dependencies: the modules
    # compiled import none of them, and what else mypy meets it reads without reporting on
    options = ["--follow-imports=silent"]
    setup(ext_modules=mypycify([*options, *compiled_sources()], opt_level="3", debug_level="0"))


if __name__ == "__main__":  # setuptools runs this file as __main__
    main()
