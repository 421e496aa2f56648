"""Triton kernels for the decoder layer's small elementwise and reduction work.

``rms_norm`` and ``add_rms_norm`` (RMSNorm, optionally after adding the
residual stream, returning the new residual too), and ``silu_mul`` (SiLU of
the gate times the up projection, on one ``[num_tokens, 2 * size]`` tensor)
with its GELU twin ``gelu_tanh_mul`` (Gemma's MLP: GELU's tanh approximation).
Each is one launch where transformers' modules take four to eight. Roundings
follow transformers' modules (Llama's RMSNorm and MLP): the residual sum in
the input dtype, the normalised row rounded to it before the weight
multiplies, the SiLU rounded before the product; reductions in float32.
Oracles: ``pagedkv.kernels.reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.checks import FLOAT_DTYPES


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden_size]
    residual_ptr,  # [num_tokens, hidden_size] (read when HAS_RESIDUAL)
    weight_ptr,  # [hidden_size]
    out_ptr,  # [num_tokens, hidden_size]
    residual_out_ptr,  # [num_tokens, hidden_size] (written when HAS_RESIDUAL)
    x_stride,
    residual_stride,
    out_stride,
    residual_out_stride,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + token * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + token * residual_stride + cols, mask=mask, other=0.0)
        x = (x + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + token * residual_out_stride + cols, x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden_size
    normed = (x * tl.math.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, (normed * weight).to(dtype), mask=mask)


def _check_rows(name: str, tensor: torch.Tensor, like: torch.Tensor | None = None) -> None:
    if tensor.ndim != 2 or tensor.dtype not in FLOAT_DTYPES or tensor.stride(-1) != 1:
        raise ValueError(f"{name}: expected a float [num_tokens, size] tensor, last dim contiguous")
    if like is not None and (tensor.shape != like.shape or tensor.dtype != like.dtype):
        raise ValueError(
            f"{name}: {tuple(tensor.shape)} {tensor.dtype}, expected "
            f"{tuple(like.shape)} {like.dtype}"
        )


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_rows("x", x)
    if residual is not None:
        _check_rows("residual", residual, like=x)
    hidden_size = x.shape[1]
    if weight.shape != (hidden_size,) or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous [{hidden_size}] tensor")
    if weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"weight: dtype {weight.dtype} is not one of {FLOAT_DTYPES}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = None if residual is None else torch.empty_like(out)
    if len(x):
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(len(x),)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            residual_out if residual_out is not None else out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            out.stride(0),
            hidden_size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=max(1, min(16, block // 512)),
        )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x)`` per row of ``x`` ``[num_tokens, hidden_size]``."""
    out, _ = _launch_rms_norm(x, None, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rmsnorm(x + residual), x + residual)``, both new tensors."""
    out, residual_out = _launch_rms_norm(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out


@triton.jit
def _act_mul_kernel(
    gate_up_ptr,  # [num_tokens, 2 * size]: the gate, then the up projection
    out_ptr,  # [num_tokens, size]
    gate_up_stride,
    out_stride,
    size,
    USE_GELU_TANH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    row = gate_up_ptr + token * gate_up_stride
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + size + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_GELU_TANH:  # 0.5 x (1 + tanh(y)), tanh(y) = 1 - 2 / (1 + exp(2 y))
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * inner)))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, (act * up).to(dtype), mask=mask)


SILU_MUL_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[num_tokens, 2 * size]`` (gate first)."""
    return _act_mul(gate_up, gelu_tanh=False)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up``, as ``silu_mul``."""
    return _act_mul(gate_up, gelu_tanh=True)


def _act_mul(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    _check_rows("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: {gate_up.shape[1]} columns is not 2 * size")
    size = gate_up.shape[1] // 2
    out = gate_up.new_empty((len(gate_up), size))
    if len(gate_up) and size:
        block = min(SILU_MUL_BLOCK, triton.next_power_of_2(size))
        grid = (len(gate_up), triton.cdiv(size, block))
        _act_mul_kernel[grid](
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            size,
            USE_GELU_TANH=gelu_tanh,
            BLOCK=block,
            num_warps=4,
        )
    return out
