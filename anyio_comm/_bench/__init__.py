"""The ``anyio-comm bench`` and ``anyio-comm serve`` commands (see docs/guides/benchmarking)."""

from __future__ import annotations

from ._arguments import whole_number
from ._cli import OneLineParser, add_parsers, bench_main, serve_main

__all__ = ["OneLineParser", "add_parsers", "bench_main", "serve_main", "whole_number"]
