"""Sphinx configuration: MyST Markdown pages, API reference from the docstrings."""

from __future__ import annotations

import anyio_comm

project = "anyio-comm"
author = "the anyio-comm developers"
copyright = "2026, the anyio-comm developers"
release = version = anyio_comm.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "furo"
html_title = f"anyio-comm {release}"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Built offline (no intersphinx inventories): names from other projects are
# not linked, and nitpicky mode must not fail on them.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(anyio|ssl|socket|collections|contextlib|typing|typing_extensions)\..*"),
    (r"py:.*", r"(msgpack|pickle)\..*"),
    (r"py:.*", r"(Buffer|Any|Awaitable|Callable|AsyncIterator|Iterable|Mapping|Sequence)"),
    (r"py:.*", r"(NoReturn|TaskStatus|ByteStream|ObjectStream|SSLContext|Limits|Comm|Listener)"),
    (r"py:.*", r"(OptionsKeywords|PooledOptionsKeywords|Balance)"),
    (r"py:.*", r"(AbstractAsyncContextManager|Coroutine)"),
    (r"py:.*", r"(Handshake|Allocator|Handler|MemoryByteStream|bytes|int|float|str|bool|None)"),
    (r"py:.*", r"(BrokenResourceError|ClosedResourceError|EndOfStream|BusyResourceError)"),
    (r"py:.*", r"(TimeoutError|OSError|ValueError|TypeError|NotImplementedError|T_co|T)"),
]
# The golden vectors in the wire spec are fenced as ```hex golden:NAME, which
# no highlighter knows.
suppress_warnings = ["misc.highlighting_failure"]
