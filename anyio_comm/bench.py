"""Helpers for benchmarking anyio-comm: what ``anyio-comm bench`` and the repository's
benchmark scripts (``benchmarks/``) share.

* the event loops: :data:`BACKENDS` and :func:`run_backend`;
* command-line values: :func:`parse_size` and :func:`format_size`, and the argparse types
  :func:`byte_size` and :func:`whole_number`;
* TLS with test certificates made by trustme: :func:`certificates`, then
  :func:`server_context` and :func:`client_context`;
* processes: :func:`choose_cpus` and :class:`Child`, a child process that runs pinned to a
  CPU and reports its result or its failure on a pipe; :class:`GilHolder`;
* what a run records: :func:`run_metadata`, :func:`versions`, :func:`load_average` and
  :func:`write_json`.
"""

from __future__ import annotations

from ._bench._arguments import byte_size as byte_size
from ._bench._arguments import format_size as format_size
from ._bench._arguments import parse_size as parse_size
from ._bench._arguments import whole_number as whole_number
from ._bench._common import BACKENDS as BACKENDS
from ._bench._common import RunError as RunError
from ._bench._common import backend_installed as backend_installed
from ._bench._common import run_backend as run_backend
from ._bench._metadata import load_average as load_average
from ._bench._metadata import run_metadata as run_metadata
from ._bench._metadata import versions as versions
from ._bench._metadata import write_json as write_json
from ._bench._processes import Child as Child
from ._bench._processes import choose_cpus as choose_cpus
from ._bench._server import GilHolder as GilHolder
from ._bench._tls import TLS_VERSIONS as TLS_VERSIONS
from ._bench._tls import TLSFiles as TLSFiles
from ._bench._tls import certificates as certificates
from ._bench._tls import client_context as client_context
from ._bench._tls import server_context as server_context

__all__ = [
    "BACKENDS",
    "TLS_VERSIONS",
    "Child",
    "GilHolder",
    "RunError",
    "TLSFiles",
    "backend_installed",
    "byte_size",
    "certificates",
    "choose_cpus",
    "client_context",
    "format_size",
    "load_average",
    "parse_size",
    "run_backend",
    "run_metadata",
    "server_context",
    "versions",
    "whole_number",
    "write_json",
]
