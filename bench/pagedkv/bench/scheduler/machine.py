"""The machine and versions every benchmark report records."""

from __future__ import annotations

import contextlib
import os
import platform
from typing import Any


def machine_info(device: str) -> dict[str, Any]:
    """The platform, Python, CPU count, the versions of grpcio, protobuf,
    torch, transformers and triton, and on ``cuda`` the GPU's name."""
    import importlib.metadata as metadata

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    for name in ("grpcio", "protobuf", "torch", "transformers", "triton"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            info[name] = metadata.version(name)
    if device.startswith("cuda"):
        import subprocess

        info["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    return info
