"""The fused decoder-layer kernels (RMSNorm with the residual add, SiLU-mul,
rotary with the KV cache write) against their oracles, both backends; on the
GPU when there is one, else under TRITON_INTERPRET=1 on the CPU."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import norm_act, reference, rotary, torch_backend
from tests.kernels.test_triton_kernels import DEVICE, run

DTYPES = [torch.float32, torch.float16]


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-3


def llama_cos_sin(max_position: int, head_size: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_size, 2).float() / head_size)
    angles = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [64, 40])  # a power of two, and one that is masked
def test_rms_norm_and_add_rms_norm_match_the_oracles(dtype: torch.dtype, hidden_size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 5, hidden_size, generator=gen).to(dtype) * 3
    weight = (torch.rand(hidden_size, generator=gen) + 0.5).to(dtype)
    tol = tolerance(dtype)
    for module in (norm_act, torch_backend):
        out = run(module.rms_norm, x, weight, 1e-5)
        expected = reference.rms_norm(x, weight, 1e-5)
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
        out, new_residual = run(module.add_rms_norm, x, residual, weight, 1e-5)
        expected, expected_residual = reference.add_rms_norm(x, residual, weight, 1e-5)
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
        assert torch.equal(new_residual, expected_residual)
        assert new_residual.dtype == dtype


def test_rms_norm_reads_rows_of_a_strided_input() -> None:
    x = torch.randn(4, 48)[:, :32]  # row stride 48
    weight = torch.rand(32) + 0.5
    out = run(norm_act.rms_norm, x, weight, 1e-6)
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6), atol=1e-5, rtol=1e-5)


def test_rms_norm_matches_llamas_module() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(32, eps=1e-6)
    module.weight.data = torch.rand(32) + 0.5
    x = torch.randn(3, 32)
    assert torch.equal(reference.rms_norm(x, module.weight.data, 1e-6), module(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_oracle(dtype: torch.dtype) -> None:
    gate_up = (torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    expected = reference.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(expected, torch.nn.functional.silu(gate) * up)
    for module in (norm_act, torch_backend):
        out = run(module.silu_mul, gate_up)
        torch.testing.assert_close(out, expected, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_matches_the_oracle_and_gemmas_mlp(dtype: torch.dtype) -> None:
    from transformers.activations import ACT2FN

    gate_up = (torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    expected = reference.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(expected, ACT2FN["gelu_pytorch_tanh"](gate) * up)
    for module in (norm_act, torch_backend):
        out = run(module.gelu_tanh_mul, gate_up)
        torch.testing.assert_close(out, expected, atol=tolerance(dtype), rtol=tolerance(dtype))


def test_the_launchers_name_bad_arguments() -> None:
    with pytest.raises(ValueError, match="weight"):
        norm_act.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        norm_act.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="gate_up"):
        norm_act.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="gate_up"):
        norm_act.gelu_tanh_mul(torch.randn(2, 7))
    cache = torch.zeros(4, 4, 1, 8)
    q, k, v = torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    positions = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="cos_sin"):
        rotary.rotary_and_cache(
            q, k, v, torch.ones(8, 6), positions, cache, cache.clone(), positions
        )
    with pytest.raises(ValueError, match="key"):
        rotary.rotary_and_cache(
            q, q, v, torch.ones(8, 8), positions, cache, cache.clone(), positions
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_size"), [(4, 2, 16), (3, 1, 12)])
def test_rotary_and_cache_matches_the_oracle(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_size: int
) -> None:
    gen = torch.Generator().manual_seed(2)
    num_tokens, num_blocks, block_size = 6, 5, 4
    cos_sin = llama_cos_sin(32, head_size).to(dtype)
    positions = torch.tensor([0, 1, 2, 17, 31, 5])
    slots = torch.tensor([4, 5, 6, 13, -1, 19])  # one padding token writes nothing
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_size, generator=gen)
    qkv = qkv.to(dtype)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    expected = [t.clone() for t in (qkv, key_cache, value_cache)]

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        # Views of one packed projection, as the model hands them over.
        return list(t.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1))

    reference.rotary_and_cache(*split(expected[0]), cos_sin, positions, *expected[1:], slots)
    tol = tolerance(dtype)
    for module in (rotary, torch_backend):
        packed, caches = qkv.clone(), [key_cache.clone(), value_cache.clone()]
        query, key, value = split(packed.to(DEVICE))
        on_device = [c.to(DEVICE) for c in caches]
        module.rotary_and_cache(
            query, key, value, cos_sin.to(DEVICE), positions.to(DEVICE), *on_device,
            slots.to(DEVICE),
        )  # fmt: skip
        torch.testing.assert_close(query.cpu(), split(expected[0])[0], atol=tol, rtol=tol)
        torch.testing.assert_close(key.cpu(), split(qkv)[1])  # the key itself is not rotated
        for got, want in zip(on_device, expected[1:], strict=True):
            torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)


def test_rotary_matches_llamas_apply_rotary_pos_emb() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_size, positions = 16, torch.tensor([0, 3, 9])
    cos_sin = llama_cos_sin(16, head_size)
    cos = torch.cat([cos_sin[positions, :8]] * 2, dim=-1)[None]  # [1, T, D] as HF builds it
    sin = torch.cat([cos_sin[positions, 8:]] * 2, dim=-1)[None]
    q, k = torch.randn(2, 1, 4, 3, head_size)  # [1, H, T, D]
    q_hf, _ = apply_rotary_pos_emb(q, k, cos, sin)
    ours = reference.rotary_embedding(q[0].transpose(0, 1), cos_sin, positions)
    assert torch.equal(ours, q_hf[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_size"), [(4, 2, 32), (6, 3, 64)])
def test_rotate_stores_the_key_in_the_hadamard_basis_and_keeps_every_score(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_size: int
) -> None:
    """``rotate``: both backends match the oracle, which is the rotary
    embedding times ``fp8_kv.hadamard``; the rotated query's scores against
    the cached keys are the scores without ``rotate``; the value is cached
    as given."""
    from pagedkv.kernels import fp8_kv

    gen = torch.Generator().manual_seed(3)
    num_tokens, num_blocks, block_size = 5, 4, 4
    cos_sin = llama_cos_sin(32, head_size).to(dtype)
    positions = torch.tensor([0, 3, 9, 17, 31])
    slots = torch.tensor([4, 5, 6, -1, 9])
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_size, generator=gen)
    qkv = qkv.to(dtype)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    sizes = [num_q_heads, num_kv_heads, num_kv_heads]
    results = {}
    for name, module, rotate in (
        ("oracle", reference, True),
        ("plain", reference, False),
        ("triton", rotary, True),
        ("torch", torch_backend, True),
    ):
        on = "cpu" if module is reference else DEVICE
        query, key, value = qkv.clone().to(on).split(sizes, dim=1)
        caches = [torch.zeros(cache_shape, dtype=dtype, device=on) for _ in range(2)]
        module.rotary_and_cache(
            query, key, value, cos_sin.to(on), positions.to(on), *caches, slots.to(on),
            rotate=rotate,
        )  # fmt: skip
        results[name] = (query.cpu(), caches[0].cpu(), caches[1].cpu())
    tol = tolerance(dtype)
    for name in ("triton", "torch"):
        for got, want in zip(results[name], results["oracle"], strict=True):
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    rotation = fp8_kv.hadamard(head_size)
    plain_query, plain_keys, plain_values = results["plain"]
    query, keys, values = results["oracle"]
    torch.testing.assert_close(
        keys.float(), (plain_keys.float() @ rotation).to(dtype).float(), atol=tol, rtol=tol
    )
    assert torch.equal(values, plain_values)
    group = num_q_heads // num_kv_heads
    written = slots[slots >= 0]
    for kv_head in range(num_kv_heads):
        heads = slice(kv_head * group, (kv_head + 1) * group)
        flat = keys.flatten(0, 1)[written, kv_head].float()
        plain_flat = plain_keys.flatten(0, 1)[written, kv_head].float()
        scores = query[:, heads].float() @ flat.T
        plain_scores = plain_query[:, heads].float() @ plain_flat.T
        torch.testing.assert_close(scores, plain_scores, atol=20 * tol, rtol=20 * tol)


def test_rotate_needs_a_head_size_that_is_a_power_of_two() -> None:
    q = torch.randn(2, 2, 48)
    kv = torch.randn(2, 1, 48)
    cache = torch.zeros(2, 4, 1, 48)
    for module in (rotary, torch_backend):
        with pytest.raises(ValueError, match="rotate: needs a head size"):
            module.rotary_and_cache(
                q, kv, kv.clone(), torch.ones(8, 48), torch.tensor([0, 1]), cache,
                cache.clone(), torch.tensor([0, 1]), rotate=True,
            )  # fmt: skip
