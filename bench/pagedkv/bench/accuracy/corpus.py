"""Text that ships with every Python: the corpus a model is trained on to
measure what a lossy KV cache costs.

Random weights make attention nearly uniform and hide a KV cache's
quantization error, so accuracy is measured on a model that has learned
something (``train.py``). Nothing is downloaded: the corpus is the
standard library's own source (its ``.py`` files, test suites left out:
code, comments and docstrings) and the help topics of ``pydoc_data``, read
in sorted order, each document's UTF-8 bytes followed by one end-of-text
byte. Every ``held_out_every``-th document goes to the held-out split
instead, for evaluation only. The same Python version gives the same
corpus (its SHA-256 is reported); other versions differ a little.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import NamedTuple

SEPARATOR = b"\n\x00\n"  # between documents: a NUL byte no source text holds
SKIPPED_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages"})


class Corpus(NamedTuple):
    """The training and held-out bytes and what they came from."""

    train: bytes
    held_out: bytes
    num_documents: int
    sha256: str  # of train, then held_out

    def describe(self) -> dict[str, object]:
        return {
            "source": "the Python standard library's .py files (tests left out) and "
            "pydoc_data's help topics",
            "documents": self.num_documents,
            "train_bytes": len(self.train),
            "held_out_bytes": len(self.held_out),
            "sha256": self.sha256,
        }


def documents() -> list[bytes]:
    """The documents in their fixed order: the help topics (by name), then
    the standard library's sources (by path)."""
    from pydoc_data.topics import topics

    docs = [topics[name].encode() for name in sorted(topics)]
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_PARTS.intersection(path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(text.encode())
    return docs


def load(held_out_every: int = 20, max_bytes: int | None = None) -> Corpus:
    """The corpus, every ``held_out_every``-th document held out; with
    ``max_bytes``, documents are taken only until the training split holds
    that many bytes (for quick runs)."""
    if held_out_every < 2:
        raise ValueError("held_out_every: at least 2")
    train, held_out = bytearray(), bytearray()
    count = 0
    for i, doc in enumerate(documents()):
        if max_bytes is not None and len(train) >= max_bytes:
            break
        target = held_out if i % held_out_every == held_out_every - 1 else train
        target += doc + SEPARATOR
        count += 1
    digest = hashlib.sha256(bytes(train) + bytes(held_out)).hexdigest()
    return Corpus(bytes(train), bytes(held_out), count, digest)
