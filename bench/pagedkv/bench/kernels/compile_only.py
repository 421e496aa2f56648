"""Triton kernels built for a GPU on a machine without one: ``install``
puts in a CUDA driver that names the target and launches nothing, and
makes every kernel launch take Triton's warm-up path (compile, down to
``ptxas``'s cubin, and return), recording what it built in ``BUILT``.

It must run before any kernel is defined with ``TRITON_INTERPRET`` unset
(the interpreter's functions are not compiled), so in a process of its
own: tests/kernels/sm90_compile.py and ``python -m
pagedkv.bench.kernels.sass``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver
from triton.runtime.jit import JITFunction

SM90 = GPUTarget("cuda", 90, 32)


class Built(NamedTuple):
    """One launch's kernel: its name and its compiled form (``asm``:
    ``ptx``, ``cubin``, ...)."""

    name: str
    asm: dict[str, Any]


BUILT: list[Built] = []


class CompileOnly(CudaDriver):  # type: ignore[misc]  # triton is untyped here
    """A CUDA driver with no device: it names the target, and nothing
    asks it for more on Triton's warm-up path."""

    def __init__(self, target: GPUTarget = SM90) -> None:  # no libcuda to load
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def install(target: GPUTarget = SM90) -> None:
    """Every kernel launch from now on compiles for ``target`` (and is
    recorded in ``BUILT``) instead of running; RuntimeError when one
    yields no cubin."""
    driver.set_active(CompileOnly(target))
    run = JITFunction.run

    def compile_only(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if not kernel.asm.get("cubin"):
            raise RuntimeError(f"{self.fn.__name__}: no cubin")
        BUILT.append(Built(self.fn.__name__, kernel.asm))
        return kernel

    JITFunction.run = compile_only
