"""The fenced code blocks of the docs, for the tests that run them as written.

``code_blocks`` reads a Markdown file and returns the blocks fenced with a
language (```` ```sh ````, ```` ```python ````), optionally only those under one
heading (its subsections included); ``run_sh`` runs shell blocks the way a
reader pastes them, failing the test with their output when one fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def code_blocks(path: Path, language: str, *, section: str | None = None) -> list[str]:
    """The text of every block fenced with ``language`` in ``path``, in order.

    With ``section``, only the blocks under the heading of that exact text,
    up to the next heading of its level or above. Raises AssertionError when
    the section is missing, so a renamed heading fails the test that runs it.
    """
    blocks: list[str] = []
    fence: str | None = None  # the open fence, None outside a block
    keep = False  # the open block is one to return
    inside = section is None  # under the wanted heading
    section_level = 0
    found = section is None
    current: list[str] = []
    for line in path.read_text().splitlines():
        if fence is not None:
            if line.strip() == fence:
                if keep and inside:
                    blocks.append("\n".join(current) + "\n")
                fence, current = None, []
            else:
                current.append(line)
            continue
        opening = _FENCE.match(line)
        if opening:
            fence, keep = opening.group(1), opening.group(2) == language
            continue
        heading = _HEADING.match(line)
        if heading and section is not None:
            level = len(heading.group(1))
            if heading.group(2) == section:
                inside, section_level, found = True, level, True
            elif inside and level <= section_level:
                inside = False
    assert found, f"{path.name} has no heading {section!r}"
    return blocks


def tool_path() -> str:
    """PATH with this interpreter's bin folder first, so ``python`` and the
    console scripts of the installed packages are the environment's."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def run_sh(
    script: str,
    cwd: Path,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` with ``sh -e`` in ``cwd`` (stopping at the first
    failing command); fails the test with the script and its output if it
    exits non-zero."""
    result = subprocess.run(
        ["sh", "-e", "-c", script],
        cwd=cwd,
        env={**os.environ, "PATH": tool_path(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- script\n{script}\n--- stdout\n{result.stdout}"
        f"\n--- stderr\n{result.stderr}"
    )
    return result
