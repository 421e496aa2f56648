"""The sampler: greedy, top-k, top-p, seeded and generator-driven sampling, logprobs."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from pagedkv.executor.sampler import (
    SamplingParamsBatch,
    murmur3_32,
    sample,
    seeded_exponentials,
)
from pagedkv.executor.step_types import RowSampling
from pagedkv.v1 import common_pb2

# Chi-square critical values at p = 1e-6, by degrees of freedom: a correct
# sampler stays below them. The seeded tests are deterministic, so a pass
# here is a pass forever; the bound only says what "close" means.
CHI2_CRITICAL = {2: 27.63, 3: 30.66, 5: 35.89}

PROBS = [0.3, 0.25, 0.2, 0.12, 0.08, 0.05]


def build(
    num_rows: int,
    *,
    temperature: float | Sequence[float] = 1.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    seeds: int | Sequence[int | None] | None = None,
    positions: Sequence[int] | None = None,
    max_num_logprobs: int = 0,
) -> SamplingParamsBatch:
    """Params of ``num_rows`` rows; a scalar applies to every row."""

    def column(value: object) -> list[Any]:
        return list(value) if isinstance(value, Sequence) else [value] * num_rows

    return SamplingParamsBatch.build(
        temperature=column(temperature),
        top_k=column(top_k),
        top_p=column(top_p),
        seeds=column(seeds),
        positions=list(range(num_rows)) if positions is None else positions,
        max_num_logprobs=max_num_logprobs,
    )


def rows_of(probs: Sequence[float], num_rows: int) -> torch.Tensor:
    """``num_rows`` copies of the logits whose softmax is ``probs``."""
    return torch.tensor(probs).log().expand(num_rows, -1).contiguous()


def chi_square(token_ids: torch.Tensor, probs: Sequence[float]) -> float:
    expected = torch.tensor(probs, dtype=torch.float64) * len(token_ids)
    counts = torch.bincount(token_ids, minlength=len(probs)).to(torch.float64)
    return float(((counts - expected) ** 2 / expected).sum())


def murmur3_reference(data: bytes, seed: int) -> int:
    """MurmurHash3_x86_32 in plain Python, for inputs of whole 4-byte words."""
    h = seed
    for (k,) in struct.iter_unpack("<I", data):
        k = (k * 0xCC9E2D51) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        k = (k * 0x1B873593) & 0xFFFFFFFF
        h ^= k
        h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
        h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= len(data)
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


# Published MurmurHash3_x86_32 test vectors (data, seed, hash).
KNOWN_VECTORS = [
    (b"", 0, 0),
    (b"", 1, 0x514E28B7),
    (b"\xff\xff\xff\xff", 0, 0x76293B50),
    (b"!Ce\x87", 0, 0xF55B516B),
    (b"!Ce\x87", 0x5082EDEE, 0x2362F9DE),
    (b"\x00\x00\x00\x00", 0, 0x2362F9DE),
    (b"aaaa", 0x9747B28C, 0x5A97808A),
]


@pytest.mark.parametrize(("data", "seed", "expected"), KNOWN_VECTORS)
def test_murmur3_matches_the_published_vectors(data: bytes, seed: int, expected: int) -> None:
    assert murmur3_reference(data, seed) == expected
    if data:
        words = [torch.tensor(w) for (w,) in struct.iter_unpack("<I", data)]
        assert int(murmur3_32(words, seed)) == expected


def test_seeded_exponentials_hash_seed_position_and_token_id() -> None:
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 12345678901234567]
    positions = [0, 7, 2**32 + 5, 3, 2**40, 1000]
    signed = [s - 2**64 if s >= 2**63 else s for s in seeds]
    noise = seeded_exponentials(torch.tensor(signed), torch.tensor(positions), 40)
    for i, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        for token_id in (0, 1, 39):
            data = struct.pack("<IIIII", seed & 0xFFFFFFFF, seed >> 32, position & 0xFFFFFFFF,
                               position >> 32, token_id)  # fmt: skip
            expected = -math.log((murmur3_reference(data, 0) + 0.5) / 2**32)
            assert float(noise[i, token_id]) == pytest.approx(expected, rel=1e-6)
    assert bool((noise > 0).all())


def test_greedy_rows_take_the_argmax_with_ties_to_the_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.5, -1.0, 2.0, 2.0], [9.0, 9.0, 9.0, 9.0]])
    params = build(3, temperature=0.0, top_k=[0, 3, 1], top_p=[1.0, 0.1, 0.5], seeds=[None, 5, 6])
    assert params.all_greedy
    assert sample(logits, params).token_ids.tolist() == [1, 2, 0]
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, build(64, temperature=0.0)).token_ids, logits.argmax(-1))


def test_top_k_of_one_samples_the_argmax() -> None:
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(1))
    params = build(64, temperature=1.3, top_k=1, seeds=[i if i % 2 else None for i in range(64)])
    output = sample(logits, params, torch.Generator().manual_seed(2))
    assert torch.equal(output.token_ids, logits.argmax(-1))


def test_seeded_rows_repeat_across_calls_and_ignore_the_generator() -> None:
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(3))
    params = build(32, temperature=0.9, top_p=0.95, seeds=list(range(100, 132)))
    first = sample(logits, params, torch.Generator().manual_seed(4)).token_ids
    second = sample(logits, params, torch.Generator().manual_seed(5)).token_ids
    assert torch.equal(first, second)


def test_seeded_rows_ignore_batch_mates_and_their_row_index() -> None:
    generator = torch.Generator().manual_seed(6)
    target_logits = torch.randn(50, 200, generator=generator)
    alone = build(50, temperature=0.8, top_k=[0] * 25 + [20] * 25, seeds=7)
    expected = sample(target_logits, alone).token_ids

    # The same 50 rows, reversed and interleaved with greedy, unseeded, top-p
    # and other seeded rows, so that the batch takes the sorting path.
    mate_logits = torch.randn(50, 200, generator=generator)
    logits = torch.stack([mate_logits, target_logits.flip(0)], dim=1).reshape(100, 200)
    mates = {"temperature": [0.0, 1.0, 0.7, 1.5], "top_p": [1.0, 0.5, 0.9, 0.3]}
    mixed = build(
        100,
        temperature=[x for i in range(50) for x in (mates["temperature"][i % 4], 0.8)],
        top_k=[x for i in range(50) for x in (i % 3, 20 if 49 - i >= 25 else 0)],
        top_p=[x for i in range(50) for x in (mates["top_p"][i % 4], 1.0)],
        seeds=[x for i in range(50) for x in (None if i % 2 else i, 7)],
        positions=[x for i in range(50) for x in (i, 49 - i)],
    )
    assert mixed.any_top_p and mixed.any_unseeded_random
    tokens = sample(logits, mixed, torch.Generator().manual_seed(8)).token_ids
    assert torch.equal(tokens[1::2].flip(0), expected)


def test_different_seeds_or_positions_give_different_draws() -> None:
    keys = [(1, 0), (2, 0), (1, 1), (1 + 2**32, 0), (1, 2**32)]
    noise = seeded_exponentials(
        torch.tensor([s for s, _ in keys]), torch.tensor([p for _, p in keys]), 1000
    )
    for i in range(len(keys)):
        for j in range(i):
            assert int((noise[i] != noise[j]).sum()) > 990, (keys[i], keys[j])
    uniform = torch.zeros(64, 1000)
    by_seed = sample(uniform, build(64, seeds=list(range(64)), positions=[0] * 64)).token_ids
    by_position = sample(uniform, build(64, seeds=3)).token_ids
    assert len(set(by_seed.tolist())) >= 55
    assert len(set(by_position.tolist())) >= 55


def test_top_k_samples_only_the_k_most_likely() -> None:
    probs = [0.05, 0.3, 0.12, 0.25, 0.08, 0.2]
    tokens = sample(rows_of(probs, 3000), build(3000, top_k=3, seeds=11)).token_ids
    assert set(tokens.tolist()) == {1, 3, 5}


@pytest.mark.parametrize(("top_p", "support"), [(0.2, {1}), (0.5, {1, 3}), (0.7, {1, 3, 5})])
def test_top_p_samples_only_the_smallest_nucleus(top_p: float, support: set[int]) -> None:
    probs = [0.05, 0.3, 0.12, 0.25, 0.08, 0.2]
    tokens = sample(rows_of(probs, 3000), build(3000, top_p=top_p, seeds=12)).token_ids
    assert set(tokens.tolist()) == support


def test_seeded_sampling_follows_the_softmax() -> None:
    tokens = sample(rows_of(PROBS, 40_000), build(40_000, seeds=2024)).token_ids
    assert chi_square(tokens, PROBS) < CHI2_CRITICAL[5]


def test_temperature_top_k_and_top_p_renormalise_what_is_kept() -> None:
    # Temperature 2 flattens to sqrt(p); top-k 4 then keeps the first four.
    flat = [math.sqrt(p) for p in PROBS[:4]]
    expected = [p / sum(flat) for p in flat]
    params = build(40_000, temperature=2.0, top_k=4, seeds=99)
    tokens = sample(rows_of(PROBS, 40_000), params).token_ids
    assert chi_square(tokens, expected) < CHI2_CRITICAL[3]
    # Top-p 0.7: 0.3 + 0.25 < 0.7 <= 0.3 + 0.25 + 0.2, so three tokens stay.
    nucleus = [p / 0.75 for p in PROBS[:3]]
    tokens = sample(rows_of(PROBS, 40_000), build(40_000, top_p=0.7, seeds=98)).token_ids
    assert tokens.max() < 3
    assert chi_square(tokens, nucleus) < CHI2_CRITICAL[2]


def test_unseeded_rows_follow_the_generator() -> None:
    logits = rows_of(PROBS, 40_000)
    params = build(40_000)
    first = sample(logits, params, torch.Generator().manual_seed(13)).token_ids
    again = sample(logits, params, torch.Generator().manual_seed(13)).token_ids
    other = sample(logits, params, torch.Generator().manual_seed(14)).token_ids
    assert torch.equal(first, again)
    assert int((first != other).sum()) > 20_000
    assert chi_square(first, PROBS) < CHI2_CRITICAL[5]


def test_the_generator_is_untouched_unless_a_random_row_is_unseeded() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(15))
    generator = torch.Generator().manual_seed(16)
    state = generator.get_state()
    sample(logits, build(4, temperature=[0.0, 1.0, 0.5, 0.0], seeds=[None, 1, 2, None]), generator)
    assert torch.equal(generator.get_state(), state)
    sample(logits, build(4, temperature=[0.0, 1.0, 0.5, 0.0], seeds=[None, 1, None, 3]), generator)
    assert not torch.equal(generator.get_state(), state)


def test_logprobs_are_raw_log_softmax_at_the_chosen_ids() -> None:
    logits = 3 * torch.randn(40, 100, generator=torch.Generator().manual_seed(17))
    params = build(40, temperature=[0.0, 0.5, 2.0, 1.0] * 10, top_k=[0, 5] * 20, top_p=0.8)
    output = sample(logits, params, torch.Generator().manual_seed(18))
    expected = logits.log_softmax(-1).gather(1, output.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(output.logprobs, expected)
    assert output.logprobs.dtype == torch.float32
    assert output.top_token_ids.shape == (40, 0)
    assert output.top_logprobs.shape == (40, 0)


def test_top_logprobs_are_the_most_likely_raw_tokens_in_order() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(19))
    output = sample(logits, build(8, temperature=0.7, top_k=2, max_num_logprobs=5))
    log_probs = logits.log_softmax(-1)
    expected_ids = log_probs.argsort(dim=-1, descending=True)[:, :5]
    assert torch.equal(output.top_token_ids, expected_ids)
    torch.testing.assert_close(output.top_logprobs, log_probs.gather(1, expected_ids))
    assert bool((output.top_logprobs.diff(dim=-1) <= 0).all())


def test_banned_tokens_are_never_chosen_and_logprobs_stay_raw() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    best = logits.argmax(-1).tolist()
    banned = [(0, [best[0]]), (2, [best[2], 7]), (3, list(range(49))), (5, [best[5]])]
    greedy = build(6, temperature=[0.0, 0.0, 0.0, 0.0, 1.0, 1.0], seeds=[None] * 4 + [1, 2])
    params = greedy.with_banned(banned)
    assert params.num_banned == 1 + 2 + 49 + 1
    output = sample(logits, params, torch.Generator().manual_seed(4))
    chosen = output.token_ids.tolist()
    assert chosen[0] == logits[0].topk(2).indices[1].item()  # the best but the banned
    assert chosen[1] == best[1]  # rows without bans as before
    assert chosen[2] not in (best[2], 7)
    assert chosen[3] == 49  # the only token left
    assert chosen[5] != best[5]
    raw = logits.log_softmax(-1).gather(1, output.token_ids[:, None]).squeeze(1)
    assert torch.allclose(output.logprobs, raw)
    # Random rows never draw a banned token, however often they draw.
    many = torch.randn(1, 8).expand(512, -1).contiguous()
    draws = sample(
        many,
        build(512, seeds=list(range(512))).with_banned([(i, [0, 3]) for i in range(512)]),
    ).token_ids
    assert not set(draws.tolist()) & {0, 3}
    assert len(set(draws.tolist())) == 6


def test_with_banned_replaces_the_bans_and_none_costs_nothing() -> None:
    params = build(2, temperature=0.0)
    assert params.with_banned([]) is params
    banned = params.with_banned([(1, [4, 5])])
    assert (banned.banned_rows.tolist(), banned.banned_ids.tolist()) == ([1, 1], [4, 5])
    assert banned.with_banned([]).num_banned == 0
    built = SamplingParamsBatch.build(
        temperature=[0.0, 0.0],
        top_k=[0, 0],
        top_p=[1.0, 1.0],
        seeds=[None, None],
        positions=[0, 1],
        banned=[(0, [2])],
    )
    assert (built.num_banned, built.banned_ids.tolist()) == (1, [2])


def test_an_empty_batch_gives_empty_outputs() -> None:
    params = build(0, max_num_logprobs=3)
    output = sample(torch.empty(0, 10), params)
    assert output.token_ids.shape == (0,) and output.token_ids.dtype == torch.int64
    assert output.logprobs.shape == (0,)
    assert output.top_token_ids.shape == (0, 3)
    assert output.top_logprobs.shape == (0, 3)


def test_a_mixed_batch_applies_each_rows_params() -> None:
    probs = [0.05, 0.3, 0.12, 0.25, 0.08, 0.2]
    kinds = [  # (temperature, top_k, top_p, seed?) and the tokens it may give
        ((0.0, 2, 0.1, True), {1}),
        ((1.0, 2, 1.0, False), {1, 3}),
        ((1.0, 0, 0.5, True), {1, 3}),
        ((0.8, 0, 1.0, True), set(range(6))),
        ((1.2, 3, 0.8, False), {1, 3, 5}),
    ]
    num_repeats = 400
    rows = [kind for _ in range(num_repeats) for kind in kinds]
    params = build(
        len(rows),
        temperature=[t for (t, _, _, _), _ in rows],
        top_k=[k for (_, k, _, _), _ in rows],
        top_p=[p for (_, _, p, _), _ in rows],
        seeds=[(31 + i if seeded else None) for i, ((_, _, _, seeded), _) in enumerate(rows)],
        max_num_logprobs=2,
    )
    assert (params.max_top_k, params.any_top_p, params.any_seeded) == (3, True, True)
    output = sample(rows_of(probs, len(rows)), params, torch.Generator().manual_seed(20))
    tokens = output.token_ids.view(num_repeats, len(kinds))
    for column, (_, support) in enumerate(kinds):
        assert set(tokens[:, column].tolist()) == support
    assert output.top_token_ids.tolist() == [[1, 3]] * len(rows)
    # A seeded row gives the same token when sampled on its own.
    for row in (2, 3, 2 + 5 * 123):
        (temperature, top_k, top_p, _), _ = rows[row]
        alone = SamplingParamsBatch.build(
            temperature=[temperature], top_k=[top_k], top_p=[top_p], seeds=[31 + row],
            positions=[row],
        )  # fmt: skip
        assert sample(rows_of(probs, 1), alone).token_ids.tolist() == [int(output.token_ids[row])]


@pytest.mark.parametrize(
    ("field", "values"),
    [
        ("temperature", {"temperature": [-0.5]}),
        ("temperature", {"temperature": [math.nan]}),
        ("top_k", {"top_k": [-1]}),
        ("top_p", {"top_p": [0.0]}),
        ("top_p", {"top_p": [1.5]}),
        ("seeds", {"seeds": [2**64]}),
        ("positions", {"positions": [-1]}),
        ("top_p", {"top_p": [1.0, 1.0]}),
        ("max_num_logprobs", {"max_num_logprobs": -1}),
    ],
)
def test_build_rejects_values_out_of_range(field: str, values: dict[str, object]) -> None:
    row: dict[str, object] = {
        "temperature": [1.0],
        "top_k": [0],
        "top_p": [1.0],
        "seeds": [None],
        "positions": [0],
    }
    with pytest.raises(ValueError, match=field):
        SamplingParamsBatch.build(**{**row, **values})  # type: ignore[arg-type]


def test_sample_rejects_logits_that_do_not_fit_the_params() -> None:
    params = build(2, max_num_logprobs=4)
    with pytest.raises(ValueError, match="float32"):
        sample(torch.zeros(2, 8, dtype=torch.bfloat16), params)
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(3, 8), params)
    with pytest.raises(ValueError, match="max_num_logprobs"):
        sample(torch.zeros(2, 3), params)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_rows_give_the_same_tokens_on_cpu_and_cuda() -> None:
    seeds = torch.tensor([0, 1, -1, 2**62, -(2**63)])
    positions = torch.tensor([0, 5, 2**33, 17, 123456])
    words = [seeds[:, None] & 0xFFFFFFFF, positions[:, None] >> 32, torch.arange(1000)[None]]
    expected = murmur3_32(words, seed=0xDEADBEEF)
    assert torch.equal(expected, murmur3_32([w.cuda() for w in words], seed=0xDEADBEEF).cpu())
    noise = seeded_exponentials(seeds, positions, 1000)
    assert torch.equal(noise, seeded_exponentials(seeds.cuda(), positions.cuda(), 1000).cpu())

    logits = torch.randn(256, 32_000, generator=torch.Generator().manual_seed(21))
    kwargs = {
        "temperature": [0.0, 0.7, 1.0, 1.3] * 64,
        "top_k": [0, 0, 50, 0] * 64,
        "top_p": [1.0, 0.9, 1.0, 0.95] * 64,
        "seeds": list(range(1000, 1256)),
        "positions": list(range(256)),
        "max_num_logprobs": 5,
    }
    on_cpu = sample(logits, SamplingParamsBatch.build(**kwargs))  # type: ignore[arg-type]
    on_cuda = sample(logits.cuda(), SamplingParamsBatch.build(**kwargs, device="cuda"))  # type: ignore[arg-type]
    assert torch.equal(on_cpu.token_ids, on_cuda.token_ids.cpu())
    torch.testing.assert_close(on_cpu.logprobs, on_cuda.logprobs.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_build_and_sample_never_wait_for_the_device() -> None:
    logits = torch.randn(4, 1000, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        params = SamplingParamsBatch.build(
            temperature=[0.0, 1.0, 0.7, 1.2],
            top_k=[0, 5, 0, 20],
            top_p=[1.0, 1.0, 0.9, 0.8],
            seeds=[None, 3, None, 2**64 - 1],
            positions=[0, 1, 2, 3],
            max_num_logprobs=3,
            device="cuda",
        )
        sample(logits, params)
        sample(logits, params.with_banned([(0, [1, 2]), (3, [7])]))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_min_tokens_bans_stop_and_eos_tokens_until_the_prompt_plus_min_tokens() -> None:
    params = common_pb2.SamplingParams(min_tokens=3, stop_token_ids=[9, 4])
    assert RowSampling.from_proto(params, eos_token_ids=(2,), num_prompt_tokens=10) == RowSampling(
        1.0, 1.0, 0, None, 0, min_tokens_until=13, min_tokens_ids=(2, 4, 9)
    )
    params.ignore_eos = True
    assert RowSampling.from_proto(params, (2,), 10).min_tokens_ids == (4, 9)
    params.ClearField("stop_token_ids")  # nothing to ban: no minimum
    assert RowSampling.from_proto(params, (2,), 10).min_tokens_until == 0
    assert RowSampling.from_proto(common_pb2.SamplingParams(stop_token_ids=[9]), (2,), 10) == (
        RowSampling(1.0, 1.0, 0, None, 0)
    )
