"""The kernels on a GPU in bfloat16 at real shapes, against the torch oracles."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import cache_ops, paged_attention, reference, slot_mapping
from tests.kernels.test_reference import build_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NAMES = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")


def on_gpu(batch: dict[str, object]) -> dict[str, object]:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (512, None), (None, 30.0)])
def test_bf16_paged_attention_matches_the_oracle(
    head_size: int, sliding_window: int | None, softcap: float | None
) -> None:
    # Decodes over long contexts, a long prefill, a chunk over cached context.
    batch = on_gpu(
        build_batch(
            [2047, 4095, 0, 1000],
            [1, 1, 700, 300],
            num_q_heads=32,
            num_kv_heads=8,
            dtype=torch.bfloat16,
            head_size=head_size,
        )
    )
    args = [batch[name] for name in NAMES]
    kwargs = {"scale": head_size**-0.5, "sliding_window": sliding_window, "softcap": softcap}
    expected = reference.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    out = paged_attention.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_bf16_cache_ops_and_slot_mapping_match_the_oracles() -> None:
    key_cache = torch.randn(64, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.randn_like(key_cache)
    key, value = torch.randn(2, 300, 8, 128, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)

    src_dst = torch.tensor([[3, 9], [10, 4]], device="cuda")
    expected = [key_cache.clone()], [value_cache.clone()]
    reference.copy_blocks(*expected, src_dst)
    cache_ops.copy_blocks([key_cache], [value_cache], src_dst)
    assert torch.equal(key_cache, expected[0][0]) and torch.equal(value_cache, expected[1][0])

    starts = torch.tensor([0, 5, 6, 40], device="cuda")
    positions = torch.cat([torch.arange(5), torch.arange(9, 10), torch.arange(100, 134)]).cuda()
    block_table = torch.randperm(63, device="cuda").add(1).view(3, 21).to(torch.int32)
    assert torch.equal(
        slot_mapping.compute_slot_mapping(starts, positions, block_table, 16),
        reference.compute_slot_mapping(starts, positions, block_table, 16),
    )


@pytest.mark.parametrize("num_tokens", [1, 64, 700])
def test_bf16_fused_layer_ops_match_the_oracles_and_transformers(num_tokens: int) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from pagedkv.kernels import norm_act, rotary

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    hidden, intermediate, num_q_heads, num_kv_heads, head_size = 4096, 14336, 32, 8, 128
    x, residual = randn(num_tokens, hidden), randn(num_tokens, hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5).cuda().to(torch.bfloat16)
    norm.weight.data = randn(hidden).abs() + 0.5
    # Against transformers' own module and the residual add it follows.
    total = residual + x
    out, new_residual = norm_act.add_rms_norm(x, residual, norm.weight, 1e-5)
    assert torch.equal(new_residual, total)
    torch.testing.assert_close(out, norm(total), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(
        norm_act.rms_norm(x, norm.weight, 1e-5), reference.rms_norm(x, norm.weight, 1e-5)
    )

    gate_up = randn(num_tokens, 2 * intermediate)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(norm_act.silu_mul(gate_up), expected, atol=1e-2, rtol=1e-2)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(norm_act.gelu_tanh_mul(gate_up), expected, atol=1e-2, rtol=1e-2)

    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_size, 2, device="cuda") / head_size)
    angles = torch.arange(8192, device="cuda")[:, None].float() * inv_freq[None]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.bfloat16)
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda", generator=gen)
    qkv = randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_size)
    query, key, value = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    key_cache = torch.zeros(64, 16, num_kv_heads, head_size, device="cuda", dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(64 * 16, device="cuda", generator=gen)[:num_tokens]
    half = head_size // 2
    cos = torch.cat([cos_sin[positions, :half]] * 2, dim=-1)[None]  # [1, T, D] as HF has it
    sin = torch.cat([cos_sin[positions, half:]] * 2, dim=-1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin
    )
    value_before = value.clone()
    rotary.rotary_and_cache(query, key, value, cos_sin, positions, key_cache, value_cache, slots)
    tol = {"atol": 3e-2, "rtol": 2e-2}  # transformers rounds each product to bf16
    torch.testing.assert_close(query, q_hf[0].transpose(0, 1), **tol)
    blocks, offsets = slots // 16, slots % 16
    torch.testing.assert_close(key_cache[blocks, offsets], k_hf[0].transpose(0, 1), **tol)
    assert torch.equal(value_cache[blocks, offsets], value_before)


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_seqs", [64, 3])  # one split each; many splits each
def test_bf16_rotary_decode_attention_matches_the_oracle(head_size: int, num_seqs: int) -> None:
    from pagedkv.kernels.paged_attention import rotary_decode_attention
    from tests.kernels.test_rotary_decode import decode_case

    contexts = [767] * num_seqs if num_seqs > 3 else [4095, 700, 0]
    case = decode_case(contexts, 8, torch.bfloat16, True, num_q_heads=32, head_size=head_size)
    want_caches = [case["key_cache"].clone(), case["value_cache"].clone()]
    args = dict(case, key_cache=want_caches[0], value_cache=want_caches[1])
    want = reference.rotary_decode_attention(**args, scale=head_size**-0.5)  # type: ignore[arg-type]
    on_device = {name: t.cuda() for name, t in case.items()}
    got = rotary_decode_attention(**on_device, scale=head_size**-0.5, max_seq_len=8192)  # type: ignore[arg-type]
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=2e-2, rtol=2e-2)
    for name, cache in zip(("key_cache", "value_cache"), want_caches, strict=True):
        torch.testing.assert_close(on_device[name].cpu(), cache, atol=2e-2, rtol=2e-2)


def test_bf16_greedy_sample_and_skinny_linear_at_a_decode_steps_shapes() -> None:
    from pagedkv.kernels.greedy import greedy_sample
    from pagedkv.kernels.skinny_linear import LinearTile, skinny_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 32000, device="cuda", generator=gen).to(torch.bfloat16) * 4
    ids, logprobs = greedy_sample(logits)
    want_ids, want_logprobs = reference.greedy_sample(logits)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logprobs, want_logprobs, atol=1e-4, rtol=1e-4)
    x = torch.randn(64, 5632, device="cuda", generator=gen).to(torch.bfloat16)
    weight = torch.randn(2048, 5632, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    want = x.float() @ weight.float().T
    for split_k in (1, 4):
        got = skinny_linear(x, weight, LinearTile(64, 32, 128, 4, 4, split_k))
        torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_caches_at_real_shapes_match_the_oracle(fp8: torch.dtype, per_head: bool) -> None:
    # Long decodes (flash decoding), a prefill and a chunk over cached context,
    # bf16 queries over fp8 K/V; then the write kernels' bytes against torch's
    # rounding on this device.
    from pagedkv.kernels import fp8_kv

    batch = build_batch(
        [2047, 4095, 0, 1000],
        [1, 1, 700, 300],
        num_q_heads=32,
        num_kv_heads=8,
        dtype=torch.bfloat16,
        head_size=128,
    )
    kv = {}
    for name, cache in (("k_scale", "key_cache"), ("v_scale", "value_cache")):
        tensor = batch[cache]
        assert isinstance(tensor, torch.Tensor)
        kv[name] = fp8_kv.calibrated_scale(tensor, fp8, per_head)
        batch[cache] = fp8_kv.quantize(tensor, kv[name], fp8)
    batch = on_gpu(batch)
    kv = {name: scale.cuda() for name, scale in kv.items()}
    args = [batch[name] for name in NAMES]
    for lens in (None, "decodes"):
        if lens == "decodes":  # the two decodes alone take the flash-decoding kernel
            args = [*args[:4], args[4][:2], torch.arange(3, dtype=torch.int32, device="cuda")]
            args[0] = args[0][:2]
        want = reference.paged_attention(*args, 128**-0.5, **kv)  # type: ignore[arg-type]
        got = paged_attention.paged_attention(*args, 128**-0.5, **kv)  # type: ignore[arg-type]
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)

    gen = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn(4096, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16) * 4
    value = torch.randn(4096, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    slots = torch.randperm(4096, device="cuda", generator=gen)
    caches = [torch.zeros(256, 16, 8, 128, dtype=fp8, device="cuda") for _ in range(2)]
    cache_ops.reshape_and_cache(key, value, *caches, slots, **kv)
    want_caches = [torch.zeros_like(c) for c in caches]
    block, offset = slots // 16, slots % 16
    for cache, x, scale in zip(want_caches, (key, value), kv.values(), strict=True):
        cache.view(torch.uint8)[block, offset] = fp8_kv.quantize(x, scale, fp8).view(torch.uint8)
    for got_cache, want_cache in zip(caches, want_caches, strict=True):
        assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
