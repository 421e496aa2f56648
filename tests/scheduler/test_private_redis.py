"""``pagedkv serve --redis``' private Redis leaves no directory behind however
serve ends: the reaper knows its directory before the server starts, so a
SIGKILL during start-up is covered too."""

from __future__ import annotations

import os
import shutil

import pytest

from pagedkv.scheduler.children import PrivateRedis, StartError
from pagedkv.scheduler.lifetime import Reaper


class RecordingReaper(Reaper):
    """The paths a Reaper would be given (no reaper process)."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def add(self, path: str) -> None:
        assert os.listdir(path) == []  # before anything is written there
        self.paths.append(path)


def test_the_reaper_has_the_directory_before_the_server_starts() -> None:
    reaper = RecordingReaper()
    binary = shutil.which("false")
    assert binary is not None
    with pytest.raises(StartError, match="did not start"):
        PrivateRedis(binary, timeout=10, password=True, reaper=reaper)
    (path,) = reaper.paths
    assert os.path.basename(path).startswith("pagedkv-redis-")
    assert not os.path.exists(path)  # removed by the failed start itself
