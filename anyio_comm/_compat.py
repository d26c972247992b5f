"""Version shims."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from typing import Unpack as Unpack
    from typing import final as final
else:  # sets __final__ at runtime too, like typing.final on 3.11+
    from typing_extensions import Unpack as Unpack
    from typing_extensions import final as final

__all__ = ["Unpack", "final"]
