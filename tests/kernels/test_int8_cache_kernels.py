"""int8 KV caches with a scale per token in the cache kernels, against the
oracles (``reference`` with ``int8_kv``'s semantics): writes store exactly
the oracle's values and scales, reads attend over what the oracle
dequantizes, block moves carry the scales with the values. The caches are
laid out as the executor lays them out (``int8_kv.block_storage``: values
and scales in one allocation, the values' blocks strided). Both backends;
the Triton ones on the GPU when there is one, else under TRITON_INTERPRET=1."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import triton
import triton.language as tl

from pagedkv.kernels import (
    cache_ops,
    decode_attention,
    int8_kv,
    kv_quant,
    paged_attention,
    reference,
    rotary,
    tiles,
    torch_backend,
)
from tests.kernels.test_fused_ops import llama_cos_sin
from tests.kernels.test_reference import MIXED, build_batch
from tests.kernels.test_rotary_decode import decode_case
from tests.kernels.test_triton_kernels import DEVICE

NAMES = ("query", "block_table", "seq_lens", "query_start_loc")
DECODES = ([0, 15, 16, 40, 300], [1, 1, 1, 1, 1])
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The packed PTX widening runs only where the kernels compile for a GPU.
PTX = [
    False,
    pytest.param(True, marks=pytest.mark.skipif(INTERPRETED, reason="the interpreter runs no PTX")),
]


class Int8Cache:
    """One layer's K and V as an int8 cache on ``device``: storage, values
    and scales of each (``int8_kv.block_storage``)."""

    def __init__(self, shape: torch.Size | tuple[int, ...], device: torch.device) -> None:
        self.key = int8_kv.block_storage(*shape, device=device)
        self.value = int8_kv.block_storage(*shape, device=device)

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, device: torch.device) -> Int8Cache:
        """A cache holding float caches ``keys`` and ``values`` quantized
        (each token's own scales)."""
        cache = cls(keys.shape, device)
        for (_, stored, scales), floats in ((cache.key, keys), (cache.value, values)):
            token_scales = int8_kv.token_scales(floats)
            scales.copy_(token_scales)
            stored.copy_(int8_kv.quantize(floats, token_scales))
        return cache

    @property
    def caches(self) -> list[torch.Tensor]:
        return [self.key[1], self.value[1]]

    @property
    def scales(self) -> dict[str, torch.Tensor]:
        return {"k_scale": self.key[2], "v_scale": self.value[2]}

    @property
    def storage(self) -> list[torch.Tensor]:
        return [self.key[0], self.value[0]]

    def same_as(self, other: Int8Cache) -> None:
        for got, want in zip(self.storage, other.storage, strict=True):
            assert torch.equal(got.cpu(), want.cpu())


def test_the_oracle_rounds_each_vector_on_its_own_range() -> None:
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [100.0, 3.0, -50.0, 0.01], [0.0] * 4])
    scales = int8_kv.token_scales(x)
    assert scales.dtype == torch.float16
    torch.testing.assert_close(
        scales[:2].float(), torch.tensor([1 / 127, 100 / 127]), rtol=1e-3, atol=0
    )
    assert float(scales[2]) == int8_kv.MIN_SCALE  # an all-zero vector still divides
    q = int8_kv.quantize(x, scales)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert q[0].tolist() == [127, -64, 32, 0] and q[2].tolist() == [0, 0, 0, 0]
    back = int8_kv.round_trip(x)
    assert ((back - x).abs() <= scales.float()[:, None] / 2 + 1e-6).all()  # half a step at most
    # Ties go to even, as torch.round does: 0.5 / (1 / 127) steps is not a tie,
    # but a vector whose scale is exactly 1 has ties at .5.
    ties = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]])
    assert int8_kv.quantize(ties, torch.ones(1, dtype=torch.float16)).tolist() == [
        [127, 0, 2, 2, 0, -2]
    ]


@triton.jit
def _widen_kernel(in_ptr, out_ptr, like_ptr, INT8: tl.constexpr, TRANSPOSED: tl.constexpr):
    rows = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    if TRANSPOSED:  # as attend's WIDEN_V loads a V tile
        rows = tl.trans(rows)
    like = tl.load(like_ptr + rows)
    tl.store(out_ptr + rows, tiles.widen(tl.load(in_ptr + rows), like, INT8))


@pytest.mark.parametrize("ptx", PTX, ids=["ops", "ptx"])
@pytest.mark.parametrize("transposed", [False, True], ids=["tile", "transposed"])
def test_widening_gives_every_int8_value_exactly(ptx: bool, transposed: bool) -> None:
    """``tiles.widen`` turns each of the 256 int8 values into the float16
    of the same value, each in its own place (the PTX path packs four)."""
    values = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    values = values[torch.randperm(256, generator=torch.Generator().manual_seed(0))].to(DEVICE)
    out = torch.empty(256, dtype=torch.float16, device=DEVICE)
    like = torch.zeros(256, dtype=torch.float16, device=DEVICE)
    mode = kv_quant.INT8_PTX if ptx else kv_quant.INT8_OPS
    _widen_kernel[(1,)](values, out, like, INT8=mode, TRANSPOSED=transposed)
    assert torch.equal(out.cpu(), values.cpu().to(torch.float16))


def test_a_block_stores_its_values_then_its_scales() -> None:
    storage, values, scales = int8_kv.block_storage(3, 4, 2, 64)
    assert storage.shape == (3, 4 * 2 * 64 + 4 * 2 * 2) and storage.is_contiguous()
    assert values.shape == (3, 4, 2, 64) and values.stride(0) == storage.shape[1]
    values[1, 3, 1] = 7
    scales[1, 3, 1] = 1.0
    block = storage[1]
    assert (block[: 4 * 2 * 64].reshape(4, 2, 64)[3, 1] == 7).all()
    # Each KV head's scales of the block together: [num_kv_heads, block_size].
    assert block[4 * 2 * 64 :].view(torch.float16).reshape(2, 4)[1, 3] == 1.0
    assert int(storage.count_nonzero()) == 64 + 1  # nothing else written (1.0 is 0x3c00)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cache_writes_store_the_oracles_values_and_scales(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_size, block_size = 9, 2, 64, 4
    key = (torch.randn(num_tokens, num_kv_heads, head_size, generator=gen) * 3).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-9])  # one large vector, on its own scale
    key[1, 1] = 0.0  # an all-zero vector
    query = torch.randn(num_tokens, 4, head_size, generator=gen).to(dtype)
    slots = torch.randperm(6 * block_size, generator=gen)[:num_tokens]
    slots[3] = -1  # padding: no slot
    positions = torch.randint(0, 50, (num_tokens,), generator=gen)
    cos_sin = llama_cos_sin(64, head_size).to(dtype)
    shape = (6, block_size, num_kv_heads, head_size)

    want = Int8Cache(shape, torch.device("cpu"))
    reference.reshape_and_cache(key, value, *want.caches, slots, **want.scales)
    assert want.key[2][slots[0] // block_size, slots[0] % block_size, 0] == pytest.approx(
        1e4 / 127, rel=1e-3
    )
    for module in (cache_ops, torch_backend):
        got = Int8Cache(shape, DEVICE)
        module.reshape_and_cache(
            key.to(DEVICE), value.to(DEVICE), *got.caches, slots.to(DEVICE), **got.scales
        )
        got.same_as(want)

    want_query, want = query.clone(), Int8Cache(shape, torch.device("cpu"))
    reference.rotary_and_cache(
        want_query, key, value, cos_sin, positions, *want.caches, slots, **want.scales
    )
    for module in (rotary, torch_backend):
        got = Int8Cache(shape, DEVICE)
        got_query = query.clone().to(DEVICE)
        args = (key, value, cos_sin, positions)
        module.rotary_and_cache(
            got_query, *(t.to(DEVICE) for t in args), *got.caches, slots.to(DEVICE), **got.scales
        )
        torch.testing.assert_close(got_query.cpu(), want_query, atol=1e-3, rtol=1e-3)
        got.same_as(want)


def test_a_rotated_key_is_quantized_as_the_oracle_quantizes_it() -> None:
    """``rotate`` over an int8 cache: the key in the Hadamard basis, then
    quantized. Sums in another order may round a value to the neighbouring
    step, so values are checked within one step and scales closely."""
    gen = torch.Generator().manual_seed(4)
    num_tokens, num_kv_heads, head_size, block_size = 7, 2, 64, 4
    key = (torch.randn(num_tokens, num_kv_heads, head_size, generator=gen) * 3).to(torch.float16)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(torch.float16)
    query = torch.randn(num_tokens, 4, head_size, generator=gen).to(torch.float16)
    slots = torch.tensor([0, 5, 9, -1, 13, 2, 22])
    positions = torch.randint(0, 50, (num_tokens,), generator=gen)
    cos_sin = llama_cos_sin(64, head_size).to(torch.float16)
    shape = (6, block_size, num_kv_heads, head_size)
    want = Int8Cache(shape, torch.device("cpu"))
    reference.rotary_and_cache(query.clone(), key, value, cos_sin, positions, *want.caches,
                               slots, rotate=True, **want.scales)  # fmt: skip
    for module in (rotary, torch_backend):
        got = Int8Cache(shape, DEVICE)
        args = (query.clone(), key, value, cos_sin, positions)
        module.rotary_and_cache(
            *(t.to(DEVICE) for t in args), *got.caches, slots.to(DEVICE), rotate=True, **got.scales
        )
        key_step = (got.key[1].cpu().int() - want.key[1].int()).abs().max()
        assert key_step <= 1
        torch.testing.assert_close(got.key[2].cpu(), want.key[2], rtol=2e-3, atol=0)
        assert torch.equal(got.value[0].cpu(), want.value[0])  # the value is stored as given


def check_attention(
    lens: tuple[list[int], list[int]],
    sliding_window: int | None,
    softcap: float | None,
    modules: tuple[Any, ...],
    dtype: torch.dtype = torch.float16,
) -> None:
    """Attention of each module over a batch of ``lens`` (context, query
    lengths) whose cache is int8, against the oracle's."""
    batch = build_batch(*lens, num_q_heads=4, num_kv_heads=2, dtype=dtype)
    keys, values = batch["key_cache"], batch["value_cache"]
    assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
    keys[3, 2, 1, 5] = 8.0  # a large channel in one token: only its own vector's step grows
    args = [batch[name] for name in NAMES]
    kwargs = {"scale": 0.125, "sliding_window": sliding_window, "softcap": softcap}
    host = Int8Cache.holding(keys, values, torch.device("cpu"))
    want = reference.paged_attention(args[0], *host.caches, *args[1:], **kwargs, **host.scales)  # type: ignore[arg-type]
    # The int8 cache's attention stays close to the float cache's.
    exact = reference.paged_attention(args[0], keys, values, *args[1:], **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(want, exact, atol=3e-2, rtol=3e-2)
    for module in modules:
        cache = Int8Cache.holding(keys.to(DEVICE), values.to(DEVICE), DEVICE)
        on = [t.to(DEVICE) for t in args]  # type: ignore[union-attr]
        got = module.paged_attention(on[0], *cache.caches, *on[1:], **kwargs, **cache.scales)
        torch.testing.assert_close(got.cpu(), want, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0)])
@pytest.mark.parametrize("widen_v", [True, False], ids=["widen-v", "int8-v"])
@pytest.mark.parametrize("ptx", PTX, ids=["ops", "ptx"])
def test_attention_over_an_int8_cache_matches_the_oracle(
    sliding_window: int | None,
    softcap: float | None,
    widen_v: bool,
    ptx: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Mixed batches take the prefill kernel, decode-only ones flash decoding.
    monkeypatch.setattr(paged_attention, "PREFILL_FP8_WIDEN_V", widen_v)
    monkeypatch.setattr(decode_attention, "DECODE_FP8_WIDEN_V", widen_v)
    monkeypatch.setattr(paged_attention, "PREFILL_INT8_PTX", ptx)
    monkeypatch.setattr(decode_attention, "DECODE_INT8_PTX", ptx)
    for lens in (MIXED, DECODES):
        check_attention(lens, sliding_window, softcap, (paged_attention, torch_backend))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs no PTX")
def test_the_ptx_widening_attends_bit_for_bit_as_the_ops_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both widenings give every int8 value exactly, so the kernels' outputs
    # must not differ by a bit, prefill (mixed batches) and decode alike.
    for lens in (MIXED, DECODES):
        batch = build_batch(*lens, num_q_heads=4, num_kv_heads=2, dtype=torch.float16)
        keys, values = batch["key_cache"], batch["value_cache"]
        assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
        cache = Int8Cache.holding(keys.to(DEVICE), values.to(DEVICE), DEVICE)
        on = [batch[name].to(DEVICE) for name in NAMES]  # type: ignore[union-attr]
        outputs = []
        for ptx in (False, True):
            monkeypatch.setattr(paged_attention, "PREFILL_INT8_PTX", ptx)
            monkeypatch.setattr(decode_attention, "DECODE_INT8_PTX", ptx)
            outputs.append(
                paged_attention.paged_attention(
                    on[0], *cache.caches, *on[1:], scale=0.125, **cache.scales
                )
            )
        assert torch.equal(*outputs)


@pytest.mark.parametrize("prefetch", [True, False], ids=["read-ahead", "plain"])
@pytest.mark.parametrize("scale_tiles", [False, True], ids=["scaled-scores", "scaled-tiles"])
def test_decode_over_an_int8_cache_with_the_table_read_ahead_or_not_matches_the_oracle(
    prefetch: bool, scale_tiles: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_attention, "DECODE_FP8_PREFETCH", prefetch)
    monkeypatch.setattr(decode_attention, "DECODE_INT8_SCALE_TILES", scale_tiles)
    check_attention(DECODES, 7, None, (paged_attention,))
    check_attention(DECODES, None, None, (paged_attention,), dtype=torch.float32)


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("ptx", PTX, ids=["ops", "ptx"])
def test_fused_rotary_decode_writes_and_reads_an_int8_cache(
    rotate: bool, ptx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_attention, "DECODE_INT8_PTX", ptx)
    case = decode_case([0, 15, 16, 31, 300, 7], 2, torch.float16, pad_last=True)
    want_cache = Int8Cache.holding(case["key_cache"], case["value_cache"], torch.device("cpu"))
    args = {n: t for n, t in case.items() if n not in ("key_cache", "value_cache")}
    want = reference.rotary_decode_attention(
        **args, key_cache=want_cache.caches[0], value_cache=want_cache.caches[1],  # type: ignore[arg-type]
        scale=0.125, rotate=rotate, **want_cache.scales,
    )  # fmt: skip
    for module in (paged_attention, torch_backend):
        cache = Int8Cache.holding(
            case["key_cache"].to(DEVICE), case["value_cache"].to(DEVICE), DEVICE
        )
        on = {name: t.to(DEVICE) for name, t in args.items()}
        got = module.rotary_decode_attention(
            **on, key_cache=cache.caches[0], value_cache=cache.caches[1], scale=0.125,
            rotate=rotate, **cache.scales,
        )  # fmt: skip
        torch.testing.assert_close(got.cpu(), want, atol=3e-3, rtol=3e-3)
        if rotate:  # sums in another order: a step at most
            assert (cache.key[1].cpu().int() - want_cache.key[1].int()).abs().max() <= 1
            assert torch.equal(cache.value[0].cpu(), want_cache.value[0])
        else:
            cache.same_as(want_cache)


@pytest.mark.parametrize("module", [cache_ops, torch_backend], ids=["triton", "torch"])
def test_block_moves_carry_the_scales_with_the_values(module: Any) -> None:
    gen = torch.Generator().manual_seed(3)
    shape = (6, 4, 2, 8)
    layers = [
        Int8Cache.holding(
            torch.randn(shape, generator=gen) * (i + 1), torch.randn(shape, generator=gen), DEVICE
        )
        for i in range(2)
    ]
    storage = [s for layer in layers for s in layer.storage]
    raw = [s.cpu().clone() for s in storage]
    pairs = torch.tensor([[1, 4], [2, 5]])
    module.copy_blocks(storage[::2], storage[1::2], pairs.to(DEVICE))
    reference.copy_blocks(raw[::2], raw[1::2], pairs)
    for got, want in zip(storage, raw, strict=True):
        assert torch.equal(got.cpu(), want)
    assert torch.equal(layers[0].key[2][4].cpu(), layers[0].key[2][1].cpu())  # the scales moved
    ids = torch.tensor([5, 0, 3])
    rows = torch.zeros(3, 4 * storage[0][0].numel(), dtype=torch.int8, device=DEVICE)
    module.gather_blocks(storage, ids.to(DEVICE), rows)
    want_rows = torch.zeros(rows.shape, dtype=torch.int8)
    reference.gather_blocks(raw, ids, want_rows)
    assert torch.equal(rows.cpu(), want_rows)
    module.scatter_blocks(storage, torch.tensor([1, 2, 4]).to(DEVICE), rows)
    reference.scatter_blocks(raw, torch.tensor([1, 2, 4]), want_rows)
    for got, want in zip(storage, raw, strict=True):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("module", [cache_ops, torch_backend], ids=["triton", "torch"])
def test_an_int8_caches_scales_are_checked_and_named(module: Any) -> None:
    key = torch.zeros(2, 2, 8)
    cache = Int8Cache((3, 4, 2, 8), torch.device("cpu"))
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"k_scale: a torch\.int8 cache needs its scales"):
        module.reshape_and_cache(key, key, *cache.caches, slots)
    with pytest.raises(ValueError, match=r"v_scale: expected a float16 \[3, 4, 2\] tensor"):
        module.reshape_and_cache(
            key, key, *cache.caches, slots, k_scale=cache.key[2], v_scale=torch.ones(1)
        )
    with pytest.raises(ValueError, match=r"k_scale: expected a float16 \[3, 4, 2\] tensor"):
        module.reshape_and_cache(
            key, key, *cache.caches, slots, k_scale=cache.key[2].float(), v_scale=cache.value[2]
        )
