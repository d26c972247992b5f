"""The build's one option: ``ANYIO_COMM_MYPYC=1`` compiles the sans-IO hot path with mypyc.

Without it (the default) the wheel is pure Python. With it, the modules that
``anyio_comm/_build.py`` lists are built as C extensions next to their sources, which stay
in the wheel; the compiled wheel is for the CPython version and platform it was built on,
and building it needs a C compiler and that Python's headers. An isolated build
(``pip install``, ``python -m build``) fetches ``MYPY`` into its build environment;
``--no-build-isolation`` uses the one installed. ``anyio-comm --version`` tells which form
was imported.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

#: the compiler: one release, so that a given source always compiles to the same code
MYPY = "mypy==2.4.1"


def compiled_sources() -> list[str]:
    """The files of the modules compiled: ``anyio_comm/_build.py``'s ``COMPILABLE``, which
    the package reads at run time to tell which form was imported."""
    tree = ast.parse((Path(__file__).parent / "anyio_comm" / "_build.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "COMPILABLE":
            return [name.replace(".", "/") + ".py" for name in ast.literal_eval(node.value)]
    raise SystemExit("anyio_comm/_build.py has no COMPILABLE")


def main() -> None:
    option = os.environ.get("ANYIO_COMM_MYPYC", "")
    if option.lower() not in ("", "0", "1", "false", "true"):
        raise SystemExit(f"ANYIO_COMM_MYPYC must be 0 or 1, not {option!r}")
    from setuptools import setup  # (tests/test_build.py reads this file without setuptools)

    if option.lower() not in ("1", "true"):
        setup()
        return
    try:
        from mypyc.build import mypycify
    except ImportError:
        # in an isolated build's first pass the frontend reads this requirement, installs
        # it and runs this file again; elsewhere (--no-build-isolation) it is an error
        setup(setup_requires=[MYPY])
        raise SystemExit(f"ANYIO_COMM_MYPYC=1 needs {MYPY} in the build environment") from None
    # the build environment holds the compiler, not the package's dependencies: the modules
    # compiled import none of them, and what else mypy meets it reads without reporting on
    options = ["--follow-imports=silent"]
    setup(ext_modules=mypycify([*options, *compiled_sources()], opt_level="3", debug_level="0"))


if __name__ == "__main__":  # setuptools runs this file as __main__
    main()
