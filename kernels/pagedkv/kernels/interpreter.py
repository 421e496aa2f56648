"""fp8 conversions under Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter converts floats to fp8 bit by bit and drops the carry of a
rounding that overflows the mantissa (7.9 becomes 4.0, not 8.0), so a cache
kernel run on the CPU would store wrong fp8 values. ``fix_fp8_conversions``
routes its conversions to and from fp8 through torch's (round to nearest
even, as the GPU's ``cvt.rn``); other conversions are left to it. It does
nothing unless the interpreter is on, and is safe to call more than once.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

_FIXED = False


def fix_fp8_conversions() -> None:
    global _FIXED
    if _FIXED or os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    as_torch = {
        tl.float32: (np.int32, torch.float32),
        tl.float16: (np.int16, torch.float16),
        tl.bfloat16: (np.int16, torch.bfloat16),
        tl.float8e4nv: (np.uint8, torch.float8_e4m3fn),
        tl.float8e5: (np.uint8, torch.float8_e5m2),
    }
    fp8 = (tl.float8e4nv, tl.float8e5)
    original = interpreter._convert_float

    def convert(data: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
        if (input_dtype in fp8 or output_dtype in fp8) and (
            input_dtype in as_torch and output_dtype in as_torch
        ):
            bits, source = as_torch[input_dtype]
            target = as_torch[output_dtype][1]
            array = np.ascontiguousarray(data).view(bits)
            converted = torch.from_numpy(array.copy()).view(source).to(target)
            out_bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[converted.element_size()]
            unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[converted.element_size()]
            return converted.view(out_bits).numpy().view(unsigned).reshape(data.shape)
        return original(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    _FIXED = True
