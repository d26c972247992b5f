"""Sessions: ``nox`` runs tests (Python 3.10-3.13), tests_compiled (3.11, the hot path
compiled with mypyc), tests_system_python, tests_asyncio_only,
tests_dask, lint, typecheck, docs, package.

A Python version that is not installed is skipped, unless the environment variable ``CI``
is set to ``true`` (as CI and ``.ci/run`` do): then every version of the matrix must run.
``nox -s demo`` runs the echo demo; ``nox -s bench`` a short benchmark; ``nox -s soak``
the backpressure and many-connection soak runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import nox

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
#: the operating system's own python3 (on Debian 12: 3.11.2), found on the POSIX default
#: PATH rather than the user's; "python3" (nox then reports it missing) where there is none
POSIX_PATH = os.confstr("CS_PATH") if hasattr(os, "confstr") else ""
SYSTEM_PYTHON = (POSIX_PATH and shutil.which("python3", path=POSIX_PATH)) or "python3"
CI = os.environ.get("CI", "").lower() in ("1", "true")
#: each session installs the form it tests: tests_compiled the compiled one (see setup.py),
#: every other session pure Python, whatever the caller's environment asks for
os.environ.pop("ANYIO_COMM_MYPYC", None)

nox.options.sessions = [
    "tests",
    "tests_compiled",
    "tests_system_python",
    "tests_asyncio_only",
    "tests_dask",
    "lint",
    "typecheck",
    "docs",
    "package",
]
#: the distributed release the dask backend is tested against
DISTRIBUTED = "distributed==2026.8.0"
nox.options.reuse_existing_virtualenvs = False
#: CI must run the whole matrix; locally a missing interpreter is reported and skipped
nox.options.error_on_missing_interpreters = CI


#: pytest-xdist's workers: one per CPU, at most two (the suite's timing-bounded tests are
#: checked on two CPUs; ``nox -s tests-3.11 -- -n 0`` runs in one process)
WORKERS = ("--numprocesses", "auto", "--maxprocesses", "2")


def run_pytest(
    session: nox.Session,
    extras: str,
    *pytest_args: str,
    packages: tuple[str, ...] = (),
    workers: tuple[str, ...] = WORKERS,
    compiled: bool = False,
) -> None:
    """Install the package (pure Python, or compiled with mypyc) and run pytest on it."""
    build = {"ANYIO_COMM_MYPYC": "1" if compiled else "0"}  # see setup.py
    # setuptools keeps what it built in build/ and packs a stale extension found there
    shutil.rmtree("build", ignore_errors=True)
    session.install(f".[{extras}]", *packages, env=build)
    # the tests import the package from the directory they run in: the compiled form
    # runs them in a copy of the tree without the package's sources
    tree = Path(tempfile.mkdtemp(prefix="anyio-comm-tree-")) if compiled else None
    try:
        directory = copy_tree_without_sources(session, tree) if tree else Path.cwd()
        with session.chdir(directory):
            session.run(
                "python",
                "-X",
                "dev",
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                *workers,
                *pytest_args,
                *session.posargs,
                # tests/test_build.py checks that the form installed is the one imported
                env={
                    "PYTHONASYNCIODEBUG": "0",
                    "ANYIO_COMM_EXPECT_COMPILED": build["ANYIO_COMM_MYPYC"],
                },
            )
    finally:
        if tree:
            shutil.rmtree(tree, ignore_errors=True)


#: what the tests read besides the package: everything of the sdist's but ``anyio_comm``
TREE = (
    "tests",
    "benchmarks",
    "examples",
    "docs",
    ".ci",
    "README.md",
    "LICENSE",
    "entry-points.txt",
    "noxfile.py",
    "pyproject.toml",
    "setup.py",
    "MANIFEST.in",
)


def copy_tree_without_sources(session: nox.Session, tree: Path) -> Path:
    """Copy the files the tests read into ``tree`` (in the system's temporary directory:
    nox's own would make the tests' Unix socket paths too long), not the package."""
    session.log(f"the tests run in {tree}")
    skip = shutil.ignore_patterns("__pycache__", "_build")
    for name in TREE:
        if Path(name).is_dir():
            shutil.copytree(name, tree / name, ignore=skip)
        else:
            shutil.copy2(name, tree / name)
    return tree


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """The whole suite on asyncio, asyncio+uvloop and trio."""
    run_pytest(session, "test")


@nox.session(python="3.11")
def tests_compiled(session: nox.Session) -> None:
    """The whole suite against the build compiled with mypyc (``ANYIO_COMM_MYPYC=1``), as
    the pure-Python build's on the same Python runs it."""
    run_pytest(session, "test", compiled=True)


@nox.session(python=SYSTEM_PYTHON)
def tests_system_python(session: nox.Session) -> None:
    """Every TLS test on the operating system's own Python, whose ssl module may differ from
    a python.org build's: Python before 3.10.11 and 3.11.3 (Debian 12's 3.11.2) sets
    ``ssl.OP_IGNORE_UNEXPECTED_EOF`` on every context it makes. Skipped where that Python is
    missing or does not set the option, unless ``CI`` is set."""
    probe = (
        "import ssl; option = getattr(ssl, 'OP_IGNORE_UNEXPECTED_EOF', 0); "
        "print(bool(option and ssl.create_default_context().options & option))"
    )
    sets_option = subprocess.run(
        [SYSTEM_PYTHON, "-c", probe], capture_output=True, text=True, check=False
    ).stdout.strip()
    if sets_option != "True" and not CI:
        session.skip(f"{SYSTEM_PYTHON} does not set ssl.OP_IGNORE_UNEXPECTED_EOF")
    run_pytest(session, "test", "-k", "tls", "-q")  # -k ignores case: TLS, tls1.3, ...


@nox.session(python="3.11")
def tests_asyncio_only(session: nox.Session) -> None:
    """Without the optional trio and uvloop extras: the core must not need them."""
    session.install(
        ".",
        "pytest>=8",
        "pytest-timeout>=2.3",
        "pytest-xdist>=3.5",
        "hypothesis>=6.100",
        "trustme>=1.1",
    )
    session.run(
        "python", "-m", "pytest", "-p", "no:cacheprovider", "-q", *WORKERS, *session.posargs
    )


@nox.session(python="3.11")
def tests_dask(session: nox.Session) -> None:
    """The dask backend (anyio_comm.dask) against a pinned distributed: dask's comm
    contract, a LocalCluster of worker processes, and a cluster across two network
    namespaces (needs root; CI must run it). A regular (not editable) install, as users
    get: the workers find the backend through its entry points."""
    run_pytest(
        session,
        "dask,test",
        "tests/test_dask.py",
        "tests/test_dask_cluster.py",
        "tests/test_dask_netns.py",
        packages=(DISTRIBUTED, "numpy"),
        workers=(),  # one process: the clusters start worker processes of their own
    )


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff==0.17.6")  # pinned: formatter output changes between releases
    paths = [
        "anyio_comm",
        "tests",
        "benchmarks",
        "examples",
        "docs/conf.py",
        "noxfile.py",
        "setup.py",
    ]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package."""
    session.install(".[typecheck]")
    session.run("mypy", "--strict", "anyio_comm")


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """Build the documentation; any warning (a broken reference included) fails. Then the
    docs' tests with the docs' dependencies (the plots' text sizes need matplotlib)."""
    session.install(".[docs,test]")
    session.run(
        "sphinx-build", "-W", "-n", "--keep-going", "-b", "html", "docs", "docs/_build/html"
    )
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_docs.py")


#: a line of build output that reports a problem: setuptools' "warning: ..." lines and
#: *Warning categories, and validate-pyproject's advice on entry-point names
BUILD_WARNING = re.compile(r"(?i:\bwarning\b)|Warning\b|does not follow recommended")


@nox.session(python="3.11")
def package(session: nox.Session) -> None:
    """Build the sdist and the wheel, with no warning; install the wheel, then collect the
    test suite in the unpacked sdist: every test module must import from what it holds."""
    session.install("build")
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    # setuptools reads the file list of an earlier build back from the egg-info: start
    # without it, so that the sdist holds what MANIFEST.in takes now and nothing else
    shutil.rmtree("anyio_comm.egg-info", ignore_errors=True)
    # PYTHONDONTWRITEBYTECODE makes setuptools warn that it skips byte-compiling
    output = session.run(
        "python",
        "-m",
        "build",
        "--outdir",
        str(dist),
        silent=True,
        env={"PYTHONDONTWRITEBYTECODE": None, "ANYIO_COMM_MYPYC": None},
    )
    warnings = [line for line in str(output).splitlines() if BUILD_WARNING.search(line)]
    if warnings:
        session.error("the build warned:\n" + "\n".join(warnings))
    (sdist,) = dist.glob("anyio_comm-*.tar.gz")
    (wheel,) = dist.glob("anyio_comm-*-py3-none-any.whl")  # pure Python unless asked
    session.install(f"{wheel}[test]")
    with tarfile.open(sdist) as archive:
        # extraction filters came with 3.12 and security releases of 3.10 and 3.11 (3.11.4);
        # Debian 12's 3.11.2, which runs nox there, has none
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(dist, **safe)
    with session.chdir(dist / sdist.name.removesuffix(".tar.gz")):
        pytest = ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider")
        output = session.run(*pytest, "--collect-only", silent=True)
        session.log(str(output).strip().splitlines()[-1])
        session.run(*pytest, "tests/sansio")  # and the tests run there


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The echo demo on every backend."""
    session.install(".[trio,uvloop]")
    session.run("python", "-m", "anyio_comm", "demo", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """The short comparison (anyio-comm vs raw floors, AnyIO streams, dask, pyzmq), ~3 min,
    then the memory of one 200 MB message over tcp and TLS, the buffer pool's bound,
    a new connection's first round trip with and without early data, compression, and
    remote calls from 1000 callers against plain comms, dask and gRPC."""
    session.install(".[bench]")
    session.run("python", "-m", "benchmarks.compare", "--quick", *session.posargs)
    session.run("python", "-m", "benchmarks.memory")
    session.run("python", "-m", "benchmarks.memory", "--transport", "tls")
    session.run("python", "-m", "benchmarks.buffer_pool")
    session.run("python", "-m", "benchmarks.connect_latency")
    session.run("python", "-m", "benchmarks.compression", "--sizes", "1MB,10MB", "--repeat", "2")
    session.run("python", "-m", "benchmarks.rpc_load", "--rounds", "3", "--seconds", "2")


@nox.session(python="3.11")
def soak(session: nox.Session) -> None:
    """Backpressure (2 GB per backend) and 1000 connections, each bounded in time."""
    session.install(".[bench]")
    session.run("python", "-m", "benchmarks.backpressure", "--seconds-max", "60")
    session.run("python", "-m", "benchmarks.many_connections", "--seconds-max", "60")
