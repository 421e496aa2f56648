"""``paged_attention``'s ``split``: a batch whose first entries are decodes,
over a float or fp8 cache, in two launches (the decodes, then the rest as a
batch of its own; or, with a tile schedule, the decodes' slots, then the
schedule), against the oracle over the whole batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkv.kernels import paged_attention, reference
from pagedkv.kernels.decode_split import DecodeSplit, TiledDecodes
from tests.kernels.test_fp8_cache_kernels import FORMATS, NAMES, quantized, scales
from tests.kernels.test_reference import build_batch
from tests.kernels.test_triton_kernels import DEVICE

# Three decodes (one at a block boundary, one long), then prompts' chunks
# of more and fewer than a small tile's 16 rows and a decode among them.
CONTEXTS = [15, 16, 300, 0, 17, 40, 9]
QUERIES = [1, 1, 1, 20, 9, 1, 24]
DECODES = 3


def rest_of(batch: dict[str, torch.Tensor]) -> DecodeSplit:
    """The entries after the decodes, with index vectors of their own."""
    seq_lens = batch["seq_lens"]
    starts = batch["query_start_loc"][DECODES:]
    return DecodeSplit(
        num_decodes=DECODES,
        decode_max_seq_len=int(seq_lens[:DECODES].max()),
        block_table=batch["block_table"][DECODES:].clone(),
        seq_lens=seq_lens[DECODES:].clone(),
        query_start_loc=(starts - starts[0]).to(torch.int32),
        max_query_len=max(QUERIES[DECODES:]),
        max_seq_len=int(seq_lens[DECODES:].max()),
    )


def mixed_batch(
    fp8: torch.dtype | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The test's batch over a float16 cache, or ``fp8`` blocks with their
    scales per KV head (the second dict; empty for float16)."""
    kv: dict[str, torch.Tensor] = {}
    batch = build_batch(CONTEXTS, QUERIES, num_q_heads=4, num_kv_heads=2, dtype=torch.float16)
    if fp8 is not None:
        kv = scales(2, per_head=True)
        quantized(batch, fp8, kv)
    return batch, kv  # type: ignore[return-value]


def decode_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The entries of each flash-decoding launch ``paged_attention`` makes."""
    launches: list[int] = []
    decode = paged_attention.decode

    def spy(query: torch.Tensor, *args: object) -> None:
        launches.append(len(query))
        decode(query, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(paged_attention, "decode", spy)
    return launches


@pytest.mark.parametrize("fp8", [None, *FORMATS], ids=["float16", *map(str, FORMATS)])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0)])
def test_decodes_first_in_two_launches_match_the_oracle(
    fp8: torch.dtype | None,
    sliding_window: int | None,
    softcap: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launches = decode_launches(monkeypatch)
    batch, kv = mixed_batch(fp8)
    on_device = {
        name: value.to(DEVICE) for name, value in batch.items() if isinstance(value, torch.Tensor)
    }
    args = [on_device[name] for name in NAMES]
    kv_device = {name: value.to(DEVICE) for name, value in kv.items()}
    kwargs = {"scale": 0.125, "sliding_window": sliding_window, "softcap": softcap}
    want = reference.paged_attention(*[batch[n] for n in NAMES], **kwargs, **kv)  # type: ignore[arg-type]
    got = paged_attention.paged_attention(
        *args, **kwargs, **kv_device, max_query_len=max(QUERIES), split=rest_of(on_device)
    )  # type: ignore[arg-type]
    torch.testing.assert_close(got.cpu(), want, atol=3e-3, rtol=3e-3)
    assert launches == [DECODES]  # the decodes alone, then the rest's prefill


def test_a_split_not_taken_leaves_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    # A split the batch does not match would read the wrong entries: one
    # that is not taken (no decodes first, or the switch off) leaves the
    # result the oracle's.
    launches = decode_launches(monkeypatch)
    batch = build_batch(CONTEXTS, QUERIES, num_q_heads=4, num_kv_heads=2, dtype=torch.float16)
    on_device = {
        name: value.to(DEVICE) for name, value in batch.items() if isinstance(value, torch.Tensor)
    }
    args = [on_device[name] for name in NAMES]
    want = reference.paged_attention(*[batch[n] for n in NAMES], scale=0.125)  # type: ignore[arg-type]
    wrong = DecodeSplit(
        num_decodes=DECODES,
        decode_max_seq_len=1,
        block_table=on_device["block_table"][:1],
        seq_lens=on_device["seq_lens"][:1],
        query_start_loc=on_device["query_start_loc"][:2],
        max_query_len=1,
        max_seq_len=1,
    )
    none_first = dataclasses.replace(wrong, num_decodes=0)
    got = paged_attention.paged_attention(*args, scale=0.125, split=none_first)  # type: ignore[arg-type]
    torch.testing.assert_close(got.cpu(), want, atol=3e-3, rtol=3e-3)
    monkeypatch.setattr(paged_attention, "PREFILL_SPLIT_DECODES", False)
    got = paged_attention.paged_attention(*args, scale=0.125, split=wrong)  # type: ignore[arg-type]
    torch.testing.assert_close(got.cpu(), want, atol=3e-3, rtol=3e-3)
    kv = scales(2, per_head=False)
    quantized(batch, FORMATS[0], kv)
    args = [batch[name].to(DEVICE) for name in NAMES]  # type: ignore[union-attr]
    want = reference.paged_attention(*[batch[n] for n in NAMES], scale=0.125, **kv)  # type: ignore[arg-type]
    kv_device = {name: value.to(DEVICE) for name, value in kv.items()}
    got = paged_attention.paged_attention(*args, scale=0.125, split=wrong, **kv_device)  # type: ignore[arg-type]
    torch.testing.assert_close(got.cpu(), want, atol=3e-3, rtol=3e-3)
    assert launches == []


def tiled_decodes(batch: dict[str, torch.Tensor], slots: int) -> tuple[torch.Tensor, TiledDecodes]:
    """A CUDA graph's form: a schedule of every query tile after the leading
    decodes, with spare programs, and the decode launch's ``slots`` (those
    past the decodes one token long)."""
    rows = paged_attention.tile_rows(max(QUERIES), batch["query"].shape[-1])
    schedule = [
        (entry, tile)
        for entry in range(DECODES, len(QUERIES))
        for tile in range(-(-QUERIES[entry] // rows))
    ]
    schedule += [(-1, -1)] * 3
    tiles = torch.tensor(schedule, dtype=torch.int32).T.contiguous()
    lens = torch.ones(slots, dtype=torch.int32)
    lens[:DECODES] = batch["seq_lens"][:DECODES]
    return tiles, TiledDecodes(slots, lens, max_seq_len=512)


@pytest.mark.parametrize("fp8", [None, FORMATS[0]], ids=["float16", str(FORMATS[0])])
@pytest.mark.parametrize("slots", [DECODES, 5])
def test_a_schedules_leading_decodes_in_a_launch_of_their_own_match_the_oracle(
    fp8: torch.dtype | None, slots: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slots past the decodes hold a prompt's rows, which the tiles write again.
    launches = decode_launches(monkeypatch)
    batch, kv = mixed_batch(fp8)
    tiles, decodes = tiled_decodes(batch, slots)
    args = [batch[name].to(DEVICE) for name in NAMES]  # type: ignore[union-attr]
    kv_device = {name: value.to(DEVICE) for name, value in kv.items()}
    want = reference.paged_attention(*[batch[n] for n in NAMES], scale=0.125, **kv)  # type: ignore[arg-type]
    split = TiledDecodes(slots, decodes.seq_lens.to(DEVICE), decodes.max_seq_len)
    got = paged_attention.paged_attention(
        *args, scale=0.125, max_query_len=max(QUERIES), max_seq_len=512,
        tiles=tiles.to(DEVICE), split=split, **kv_device,
    )  # type: ignore[arg-type]  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, atol=3e-3, rtol=3e-3)
    assert launches == [slots]


def test_tiled_decodes_need_a_schedule_and_fit_the_batch() -> None:
    batch = build_batch(CONTEXTS, QUERIES, num_q_heads=4, num_kv_heads=2, dtype=torch.float16)
    tiles, decodes = tiled_decodes(batch, DECODES)
    args = [batch[name].to(DEVICE) for name in NAMES]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="split: a TiledDecodes goes with tiles"):
        paged_attention.paged_attention(*args, scale=0.125, split=decodes)  # type: ignore[arg-type]
    too_many = TiledDecodes(len(CONTEXTS) + 1, torch.ones(len(CONTEXTS) + 1, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="split: 8 slots"):
        paged_attention.paged_attention(*args, scale=0.125, tiles=tiles.to(DEVICE), split=too_many)  # type: ignore[arg-type]
