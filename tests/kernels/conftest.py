"""Kernel tests run Triton kernels on the CPU through its interpreter when no
GPU is there; the variable must be set before any kernel module is imported."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
