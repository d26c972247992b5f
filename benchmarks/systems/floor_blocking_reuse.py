"""The blocking floor receiving every frame into the same buffer each time.

:mod:`benchmarks.systems.floor_blocking` with ``reuse``: a large frame is read
into the buffer of the frame of the same place and length in the previous
message, allocated (and faulted in) once per connection. What is left is the
kernel's copies and wake-ups and a thread's loop, with no frame buffer allocated
after the first message: a row to read a large-message target against when no
system reaches it (not a ceiling: with one connection the event loops beat it at
10 MB).
"""

from __future__ import annotations

import functools

from benchmarks.systems import floor_blocking

run_server = functools.partial(floor_blocking.run_server, reuse=True)
open_blocking = functools.partial(floor_blocking.open_blocking, reuse=True)
