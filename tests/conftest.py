"""Tests run Triton kernels on the CPU through its interpreter when no GPU is
there. The variable must be set before anything imports ``triton.language``,
so it is set here, before pytest imports any test module (a module that sets
it itself may come after one that already imported a kernel); the servers
that tests start inherit it."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
