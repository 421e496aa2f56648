"""A benchmark's report, printed and written beside its JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(output: str | None, report: dict[str, Any], text: str) -> Path | None:
    """Prints ``text`` (the report's markdown) and, with ``output``, writes
    ``report`` there as JSON and ``text`` beside it as ``.md``; the path
    written, or None."""
    print(text)
    if not output:
        return None
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    path.with_suffix(".md").write_text(text)
    return path
