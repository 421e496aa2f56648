"""Kernel tests run Triton kernels on the CPU through its interpreter.

The variable must be set before any Triton kernel module is imported.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
