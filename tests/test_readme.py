"""The README example runs, unchanged but for its last line, on every backend."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def readme_example() -> str:
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    lines = code.rstrip().splitlines()
    assert lines[-1].startswith("anyio.run(main)")
    return "\n".join(lines[:-1])


async def test_readme_example_runs() -> None:
    namespace: dict[str, object] = {}
    exec(compile(readme_example(), str(README), "exec"), namespace)
    await namespace["main"]()  # type: ignore[operator]
