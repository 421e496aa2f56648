"""fp8 KV caches in the cache kernels, against the oracles (``reference``
with ``fp8_kv``'s semantics): writes store exactly the oracle's bytes, reads
attend over what the oracle dequantizes, block moves copy bytes. Both
backends; the Triton ones on the GPU when there is one, else under
TRITON_INTERPRET=1 (whose fp8 conversions ``kv_quant`` routes through torch's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedkv.kernels import (
    cache_ops,
    decode_attention,
    fp8_kv,
    paged_attention,
    reference,
    rotary,
    torch_backend,
)
from tests.kernels.test_fused_ops import llama_cos_sin
from tests.kernels.test_reference import MIXED, build_batch
from tests.kernels.test_rotary_decode import decode_case
from tests.kernels.test_triton_kernels import DEVICE, run

FORMATS = list(fp8_kv.KV_CACHE_DTYPES.values())
NAMES = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")


def scales(num_kv_heads: int, per_head: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    """Scales that put N(0, 1) activations well inside the format, different per head."""
    gen = torch.Generator().manual_seed(seed)
    count = num_kv_heads if per_head else 1
    return {name: (torch.rand(count, generator=gen) + 0.5) / 64 for name in ("k_scale", "v_scale")}


def quantized(batch: dict[str, object], fp8: torch.dtype, kv: dict[str, torch.Tensor]) -> None:
    """``batch``'s caches stored in ``fp8`` with ``kv``'s scales, in place."""
    for name, scale in (("key_cache", kv["k_scale"]), ("value_cache", kv["v_scale"])):
        cache = batch[name]
        assert isinstance(cache, torch.Tensor)
        batch[name] = fp8_kv.quantize(cache, scale, fp8)


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cache_writes_store_the_oracles_bytes(
    fp8: torch.dtype, per_head: bool, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_size, block_size = 9, 2, 64, 4
    key = (torch.randn(num_tokens, num_kv_heads, head_size, generator=gen) * 3).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-9])  # saturates, zero, underflows
    query = torch.randn(num_tokens, 4, head_size, generator=gen).to(dtype)
    slots = torch.randperm(6 * block_size, generator=gen)[:num_tokens]
    slots[3] = -1  # padding: no slot
    positions = torch.randint(0, 50, (num_tokens,), generator=gen)
    cos_sin = llama_cos_sin(64, head_size).to(dtype)
    kv = scales(num_kv_heads, per_head)
    shape = (6, block_size, num_kv_heads, head_size)

    def caches() -> list[torch.Tensor]:
        return [torch.zeros(shape, dtype=fp8), torch.zeros(shape, dtype=fp8)]

    want = caches()
    reference.reshape_and_cache(key, value, *want, slots, **kv)
    for module in (cache_ops, torch_backend):
        moved = [c.to(DEVICE) for c in caches()]
        on = {name: t.to(DEVICE) for name, t in kv.items()}
        module.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), *moved, slots.to(DEVICE), **on)
        for cache, oracle in zip(moved, want, strict=True):
            same_bytes(cache, oracle)

    want_query, want = query.clone(), caches()
    reference.rotary_and_cache(want_query, key, value, cos_sin, positions, *want, slots, **kv)
    for module in (rotary, torch_backend):
        moved = [c.to(DEVICE) for c in caches()]
        got_query = query.clone().to(DEVICE)
        on = {name: t.to(DEVICE) for name, t in kv.items()}
        args = (key, value, cos_sin, positions)
        module.rotary_and_cache(
            got_query, *(t.to(DEVICE) for t in args), *moved, slots.to(DEVICE), **on
        )
        torch.testing.assert_close(got_query.cpu(), want_query, atol=1e-3, rtol=1e-3)
        for cache, oracle in zip(moved, want, strict=True):
            same_bytes(cache, oracle)


@pytest.mark.parametrize("fp8", FORMATS)
def test_a_rotated_key_is_quantized_as_the_oracle_quantizes_it(fp8: torch.dtype) -> None:
    """``rotate`` over an fp8 cache: the key in the Hadamard basis, then
    quantized. Sums in another order may round a value to the neighbouring
    fp8 code, so the check is on the values: within one step of the
    format (1/8 of a value for e4m3, 1/4 for e5m2)."""
    gen = torch.Generator().manual_seed(4)
    num_tokens, num_kv_heads, head_size, block_size = 7, 2, 64, 4
    key = (torch.randn(num_tokens, num_kv_heads, head_size, generator=gen) * 3).to(torch.float16)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(torch.float16)
    query = torch.randn(num_tokens, 4, head_size, generator=gen).to(torch.float16)
    slots = torch.tensor([0, 5, 9, -1, 13, 2, 22])
    positions = torch.randint(0, 50, (num_tokens,), generator=gen)
    cos_sin = llama_cos_sin(64, head_size).to(torch.float16)
    kv = scales(num_kv_heads, True)
    shape = (6, block_size, num_kv_heads, head_size)
    want = [torch.zeros(shape, dtype=fp8), torch.zeros(shape, dtype=fp8)]
    reference.rotary_and_cache(query.clone(), key, value, cos_sin, positions, *want, slots,
                               rotate=True, **kv)  # fmt: skip
    step = torch.finfo(fp8).eps
    for module in (rotary, torch_backend):
        moved = [torch.zeros(shape, dtype=fp8, device=DEVICE) for _ in range(2)]
        on = {name: t.to(DEVICE) for name, t in kv.items()}
        args = (query.clone(), key, value, cos_sin, positions)
        module.rotary_and_cache(
            *(t.to(DEVICE) for t in args), *moved, slots.to(DEVICE), rotate=True, **on
        )
        for cache, oracle in zip(moved, want, strict=True):
            torch.testing.assert_close(cache.cpu().float(), oracle.float(), rtol=step, atol=2.0**-9)
        same_bytes(moved[1], want[1])  # the value is stored as given


# Decodes only: contexts at and around block boundaries, and a long one.
DECODES = ([0, 15, 16, 40, 300], [1, 1, 1, 1, 1])


def check_attention(
    lens: tuple[list[int], list[int]],
    fp8: torch.dtype,
    per_head: bool,
    sliding_window: int | None,
    softcap: float | None,
    modules: tuple[Any, ...],
) -> None:
    """Attention of each module over a batch of ``lens`` (context, query
    lengths) whose cache is quantized to ``fp8``, against the oracle's."""
    kv = scales(2, per_head)
    batch = build_batch(*lens, num_q_heads=4, num_kv_heads=2, dtype=torch.float16)
    quantized(batch, fp8, kv)
    args = [batch[name] for name in NAMES]
    kwargs = {"scale": 0.125, "sliding_window": sliding_window, "softcap": softcap}
    want = reference.paged_attention(*args, **kwargs, **kv)  # type: ignore[arg-type]
    for module in modules:
        got = run(module.paged_attention, *args, **kwargs, **kv)
        torch.testing.assert_close(got, want, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0)])
@pytest.mark.parametrize("widen_v", [True, False], ids=["widen-v", "fp8-v"])
def test_attention_over_an_fp8_cache_matches_the_oracle(
    fp8: torch.dtype,
    per_head: bool,
    sliding_window: int | None,
    softcap: float | None,
    widen_v: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Mixed batches take the prefill kernel, decode-only ones flash decoding;
    # both read V tiles either way (attend's WIDEN_V).
    monkeypatch.setattr(paged_attention, "PREFILL_FP8_WIDEN_V", widen_v)
    monkeypatch.setattr(decode_attention, "DECODE_FP8_WIDEN_V", widen_v)
    for lens in (MIXED, DECODES):
        check_attention(
            lens, fp8, per_head, sliding_window, softcap, (paged_attention, torch_backend)
        )


@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0)])
@pytest.mark.parametrize("widen_v", [True, False], ids=["widen-v", "fp8-v"])
@pytest.mark.parametrize("prefetch", [True, False], ids=["read-ahead", "plain"])
def test_decode_over_an_fp8_cache_with_the_table_read_ahead_or_not_matches_the_oracle(
    sliding_window: int | None,
    softcap: float | None,
    widen_v: bool,
    prefetch: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # fp8 blocks read each tile's block table a step ahead by default
    # (DECODE_FP8_PREFETCH); the plain loop stays for float caches.
    monkeypatch.setattr(decode_attention, "DECODE_FP8_PREFETCH", prefetch)
    monkeypatch.setattr(decode_attention, "DECODE_FP8_WIDEN_V", widen_v)
    check_attention(DECODES, torch.float8_e4m3fn, True, sliding_window, softcap, (paged_attention,))


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("per_head", [False, True])
def test_fused_rotary_decode_writes_and_reads_an_fp8_cache(
    fp8: torch.dtype, per_head: bool
) -> None:
    case = decode_case([0, 15, 16, 31, 300, 7], 2, torch.float16, pad_last=True)
    kv = scales(2, per_head)
    for name, scale in (("key_cache", kv["k_scale"]), ("value_cache", kv["v_scale"])):
        case[name] = fp8_kv.quantize(case[name], scale, fp8)
    want_caches = [case["key_cache"].clone(), case["value_cache"].clone()]
    args = dict(case, key_cache=want_caches[0], value_cache=want_caches[1])
    want = reference.rotary_decode_attention(**args, scale=0.125, **kv)  # type: ignore[arg-type]
    for module in (paged_attention, torch_backend):
        on = {name: t.to(DEVICE) for name, t in case.items()}
        got = module.rotary_decode_attention(
            **on, scale=0.125, **{name: t.to(DEVICE) for name, t in kv.items()}
        )
        torch.testing.assert_close(got.cpu(), want, atol=3e-3, rtol=3e-3)
        same_bytes(on["key_cache"], want_caches[0])
        same_bytes(on["value_cache"], want_caches[1])


@pytest.mark.parametrize("fp8", FORMATS)
def test_a_rotated_one_launch_decode_stores_what_the_rotated_write_stores(
    fp8: torch.dtype,
) -> None:
    # rotate: the one-launch decode and rotary_and_cache (then attention)
    # rotate alike (the same butterflies), so the key bytes are the same.
    case = decode_case([0, 15, 16, 31, 300, 7], 2, torch.float16, pad_last=True)
    kv = {name: t.to(DEVICE) for name, t in scales(2, per_head=True).items()}
    for name, scale in (("key_cache", kv["k_scale"]), ("value_cache", kv["v_scale"])):
        case[name] = fp8_kv.quantize(case[name], scale.cpu(), fp8)
    on = {name: t.to(DEVICE) for name, t in case.items()}
    two = {name: t.clone() for name, t in on.items()}
    got = paged_attention.rotary_decode_attention(**on, scale=0.125, rotate=True, **kv)  # type: ignore[arg-type]
    query = two["query"].clone()
    rotary.rotary_and_cache(
        query, two["key"], two["value"], two["cos_sin"], two["positions"],
        two["key_cache"], two["value_cache"], two["slot_mapping"], rotate=True, **kv,
    )  # fmt: skip
    starts = torch.arange(len(query) + 1, dtype=torch.int32, device=query.device)
    want = paged_attention.paged_attention(
        query, two["key_cache"], two["value_cache"], two["block_table"], two["seq_lens"],
        starts, 0.125, max_query_len=1, **kv,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    same_bytes(on["key_cache"], two["key_cache"].cpu())
    same_bytes(on["value_cache"], two["value_cache"].cpu())


@pytest.mark.parametrize("module", [cache_ops, torch_backend], ids=["triton", "torch"])
def test_block_copies_move_fp8_bytes(module: object) -> None:
    gen = torch.Generator().manual_seed(3)
    caches = [
        (torch.randn(6, 4, 2, 8, generator=gen) * 50).to(torch.float8_e4m3fn) for _ in range(4)
    ]
    raw = [c.view(torch.uint8).clone() for c in caches]
    moved = [c.to(DEVICE) for c in caches]
    pairs = torch.tensor([[1, 4], [2, 5]])
    module.copy_blocks(moved[:2], moved[2:], pairs.to(DEVICE))  # type: ignore[attr-defined]
    reference.copy_blocks(raw[:2], raw[2:], pairs)
    for got, want in zip(moved, raw, strict=True):
        assert torch.equal(got.cpu().view(torch.uint8), want)
    ids = torch.tensor([5, 0, 3])
    rows = torch.zeros(3, 4 * caches[0][0].numel(), dtype=torch.float8_e4m3fn, device=DEVICE)
    module.gather_blocks(moved, ids.to(DEVICE), rows)  # type: ignore[attr-defined]
    want_rows = torch.zeros(rows.shape, dtype=torch.uint8)
    reference.gather_blocks(raw, ids, want_rows)
    assert torch.equal(rows.cpu().view(torch.uint8), want_rows)
    module.scatter_blocks(moved, torch.tensor([1, 2, 4]).to(DEVICE), rows)  # type: ignore[attr-defined]
    reference.scatter_blocks(raw, torch.tensor([1, 2, 4]), want_rows)
    for got, want in zip(moved, raw, strict=True):
        assert torch.equal(got.cpu().view(torch.uint8), want)


@pytest.mark.parametrize("module", [cache_ops, torch_backend], ids=["triton", "torch"])
def test_scales_are_checked_and_named(module: object) -> None:
    key = torch.zeros(2, 2, 8)
    fp8_cache = torch.zeros(3, 4, 2, 8, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([0, 1])
    write = module.reshape_and_cache  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"k_scale: a torch\.float8_e4m3fn cache needs its scales"):
        write(key, key, fp8_cache, fp8_cache.clone(), slots)
    with pytest.raises(ValueError, match=r"v_scale: expected a contiguous float32 \[1\] or \[2\]"):
        write(
            key,
            key,
            fp8_cache,
            fp8_cache.clone(),
            slots,
            k_scale=torch.ones(1),
            v_scale=torch.ones(3),
        )
    with pytest.raises(ValueError, match="only a quantized cache has scales"):
        write(
            key,
            key,
            torch.zeros(3, 4, 2, 8),
            torch.zeros(3, 4, 2, 8),
            slots,
            k_scale=torch.ones(1),
            v_scale=torch.ones(1),
        )
    with pytest.raises(ValueError, match=r"key: dtype torch.float16, the cache holds"):
        write(key.half(), key.half(), torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8), slots)
