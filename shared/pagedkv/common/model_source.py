"""Where a model's files are: a directory, or a Hugging Face id in the local cache.

Every ``--model`` takes either. ``resolve_model`` turns the name into the
directory holding ``config.json``, the tokenizer and the chat template, so
the executors, schedulers, routers and the gateway read the same files.
Models are never downloaded at run time: an id must already be in the
cache (``huggingface-cli download org/name`` or any ``from_pretrained``
fills it).

The cache is found as ``huggingface_hub`` finds it: ``HF_HUB_CACHE``, else
the legacy ``HUGGINGFACE_HUB_CACHE``, else ``HF_HOME/hub``, where
``HF_HOME`` defaults to ``$XDG_CACHE_HOME/huggingface`` or
``~/.cache/huggingface``. In it the model ``org/name`` is
``models--org--name``, whose ``refs/main`` holds the commit that
``snapshots/<commit>/`` has the files of. This module walks that layout
itself (exactly, and without importing ``huggingface_hub``), so that
naming a model costs a scheduler nothing at start.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REVISION = "main"
"""The revision of an id that is served: the one ``refs/main`` names."""

_REPO_ID = re.compile(r"(?:[A-Za-z0-9_.\-]{1,96}/)?[A-Za-z0-9_.\-]{1,96}")
"""An id as the hub spells one: ``name`` or ``org/name``."""


class ModelNotFound(ValueError):
    """A model name that is neither a directory nor an id in the local cache;
    the message is one line saying which, for ``--model NAME: <message>``."""


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process reads (see the module's docstring)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = os.environ.get("HF_HOME")
        if not home:
            xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
            home = os.path.join(xdg, "huggingface")
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is spelled like a hub id (``name`` or ``org/name``:
    letters, digits, ``-``, ``_``, ``.``; no ``--`` or ``..``; neither end a
    ``-`` or ``.``)."""
    if not _REPO_ID.fullmatch(name) or "--" in name or ".." in name:
        return False
    return all(part[0] not in "-." and part[-1] not in "-." for part in name.split("/"))


def cached_snapshot(repo_id: str, cache: Path | None = None) -> Path | None:
    """The snapshot directory of ``repo_id`` at ``REVISION`` in ``cache``
    (default: ``hub_cache_dir()``); None when the cache does not have it."""
    repo = (cache or hub_cache_dir()) / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / REVISION
    try:
        commit = ref.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    snapshot = repo / "snapshots" / commit
    if not commit or "/" in commit or not snapshot.is_dir():
        return None
    return snapshot


def resolve_model(name: str) -> Path:
    """The directory of the model ``name``: ``name`` itself when it is a
    directory, else the cached snapshot of the hub id ``name``.

    Reads the file system only; never downloads. Raises ``ModelNotFound``
    when ``name`` is a file, or neither a directory nor a cached id.
    """
    path = Path(name)
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFound("not a directory")
    if not is_hub_id(name):
        raise ModelNotFound("no such directory")
    cache = hub_cache_dir()
    snapshot = cached_snapshot(name, cache)
    if snapshot is None:
        raise ModelNotFound(
            f"not a directory and not in the Hugging Face cache at {cache} "
            "(models are not downloaded at run time; set HF_HUB_CACHE or HF_HOME)"
        )
    return snapshot


def model_dir_or_none(name: str) -> Path | None:
    """``resolve_model(name)``, or None where it would raise: for readers of
    optional files (a tokenizer), which go without when the model's files
    are not here."""
    try:
        return resolve_model(name)
    except ModelNotFound:
        return None
