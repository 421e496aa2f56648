"""The sampler: float32 logits of the entries that need a sample -> tokens and logprobs.

Everything runs on the logits' device with no host synchronisation (no
``.item()``, no branching on tensor values). Work is skipped only on host-side
facts that ``SamplingParamsBatch.build`` records from the per-request params
(all rows greedy, largest top-k, any top-p, any seeded or unseeded random row).

Per row:

- Greedy rows (temperature 0; ``build`` maps temperatures below 1e-5 to 0)
  take ``argmax`` of the raw logits, ties to the lowest id, whatever their
  top-k and top-p.
- Random rows divide the logits by their temperature, keep the ``top_k``
  largest (0: off; ties at the boundary may keep extra), then the nucleus (the
  smallest set of most likely tokens whose probability is at least ``top_p``,
  never empty; 1.0: off), and sample from the renormalised softmax by the
  exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per
  (row, token id).

Where ``E`` comes from:

- Rows without a seed draw it from the ``generator`` passed to ``sample``
  (``Tensor.exponential_``). The generator is advanced, by one draw of
  ``[num_rows, vocab_size]``, only when the batch has such a row.
- Rows with a seed compute it: ``E = -ln(u)``, ``u = (h + 0.5) / 2**32``, where
  ``h`` is MurmurHash3_x86_32 (hash seed 0) of the 20 bytes made of five
  little-endian uint32 words: seed low, seed high, position low, position high,
  token id (``seed`` as a uint64, ``position`` of the token being sampled in its
  sequence). ``h`` is computed in int64 torch ops on values kept in
  ``[0, 2**32)``; products are split into 16-bit halves so that no
  intermediate reaches ``2**49`` (no overflow, no sign), so the bits are the
  same on every device. ``u`` is strictly inside (0, 1); ``ln`` runs in
  float64 and ``E`` is rounded to float32.

  A seeded row's token is therefore a function of its own logits, params, seed
  and position alone: the same across runs and devices (up to last-bit
  differences in the devices' softmax), whatever rows share the batch and
  whichever row index it has, and independent of the generator. The hash
  costs about 25 elementwise int64 passes over ``[num_seeded_rows, vocab_size]``
  (two such int64 tensors alive at once), so it runs on the seeded rows only.

Banned tokens (``sampling.min_tokens``: a row's stop and EOS tokens before
its minimum of outputs) are taken out before all of this: their logits count
as -inf when a token is chosen, greedy or random.

Logprobs are under the raw model distribution (``log_softmax`` of the logits
before banned tokens, temperature, top-k and top-p): the chosen token's
always, and the ``max_num_logprobs`` most likely tokens' per row, most likely
first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor

MIN_TEMPERATURE = 1e-5
"""Temperatures below this count as 0 (greedy): dividing by them overflows float32."""

_MAX_SEED = 2**64
_MAX_POSITION = 2**63
_MAX_TOP_K = 2**32
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class SamplingParamsBatch:
    """Sampling params of the rows of one ``sample`` call, on the logits' device.

    Make it with ``build``, which checks the values and derives the host-side
    facts; tensor fields are not read back on the host.
    """

    temperature: Tensor  # float32 [N]; 0: greedy
    top_k: Tensor  # int64 [N]; 0: off
    top_p: Tensor  # float32 [N], in (0, 1]; 1.0: off
    seeds: Tensor  # int64 [N]: the uint64 seed's bits (two's complement); 0 where unseeded
    positions: Tensor  # int64 [N]: position of the token being sampled in its sequence
    seeded_rows: Tensor  # int64 [S]: the random rows with a seed, increasing
    all_greedy: bool  # every row is greedy: no scaling, filtering or noise at all
    any_unseeded_random: bool  # some random row has no seed: the generator is drawn from
    max_top_k: int  # largest top_k of a random row; 0 when no random row uses top-k
    any_top_p: bool  # some random row has top_p < 1
    max_num_logprobs: int  # K: top logprobs returned per row (0: none)
    banned_rows: Tensor  # int64 [B]: (row, token) pairs never sampled, with banned_ids
    banned_ids: Tensor  # int64 [B]
    num_banned: int  # B

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def any_seeded(self) -> bool:
        return self.seeded_rows.shape[0] > 0

    @property
    def any_top_k(self) -> bool:
        return self.max_top_k > 0

    @classmethod
    def build(
        cls,
        *,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        seeds: Sequence[int | None],
        positions: Sequence[int] | Tensor,
        max_num_logprobs: int = 0,
        banned: Sequence[tuple[int, Sequence[int]]] = (),
        device: torch.device | str = "cpu",
    ) -> SamplingParamsBatch:
        """One row per sampled entry, from host values.

        ``seeds[i]`` is None for an unseeded row, else a uint64 in ``[0, 2**64)``.
        ``banned``: (row, token ids it may not sample) pairs (see ``with_banned``).
        ``positions`` may already be a tensor (then it is not checked: it would
        need a sync). The values reach a CUDA device in two non-blocking copies
        from pinned memory: the host does not wait. Raises ValueError, naming
        the field and row, on any value outside its documented range or on
        lists of different lengths.
        """
        num_rows = len(temperature)
        for name, column in (("top_k", top_k), ("top_p", top_p), ("seeds", seeds)):
            if len(column) != num_rows:
                raise ValueError(f"{name}: {len(column)} values for {num_rows} rows")
        if len(positions) != num_rows:
            raise ValueError(f"positions: {len(positions)} values for {num_rows} rows")
        if max_num_logprobs < 0:
            raise ValueError(f"max_num_logprobs: {max_num_logprobs} is negative")

        temperatures = [_check_temperature(i, t) for i, t in enumerate(temperature)]
        random_rows = [i for i, t in enumerate(temperatures) if t > 0]
        for i in range(num_rows):
            _check_row(i, top_k[i], top_p[i], seeds[i])
        seeded_rows = [i for i in random_rows if seeds[i] is not None]
        top_ks = [top_k[i] for i in random_rows if top_k[i] > 0]

        if isinstance(positions, Tensor):
            position_tensor = _to_device(positions.to(torch.int64), device)
        else:
            for i, position in enumerate(positions):
                if not 0 <= position < _MAX_POSITION:
                    raise ValueError(f"positions[{i}]: {position} is not in [0, 2**63)")
            position_tensor = _to_device(torch.tensor(positions, dtype=torch.int64), device)

        # Two host-to-device copies, split into views on the device.
        floats = _to_device(torch.tensor([temperatures, list(top_p)], dtype=torch.float32), device)
        int_values = [*top_k, *(_to_int64(s) if s is not None else 0 for s in seeds), *seeded_rows]
        ints = _to_device(torch.tensor(int_values, dtype=torch.int64), device)
        no_bans = ints[:0]
        params = cls(
            temperature=floats[0],
            top_k=ints[:num_rows],
            top_p=floats[1],
            seeds=ints[num_rows : 2 * num_rows],
            positions=position_tensor,
            seeded_rows=ints[2 * num_rows :],
            all_greedy=not random_rows,
            any_unseeded_random=len(seeded_rows) < len(random_rows),
            max_top_k=max(top_ks, default=0),
            any_top_p=any(top_p[i] < 1.0 for i in random_rows),
            max_num_logprobs=max_num_logprobs,
            banned_rows=no_bans,
            banned_ids=no_bans,
            num_banned=0,
        )
        return params.with_banned(banned) if banned else params

    def with_banned(self, banned: Sequence[tuple[int, Sequence[int]]]) -> SamplingParamsBatch:
        """These params with ``banned`` as their banned tokens: (row, token
        ids) pairs, rows in ``[0, num_rows)``, ids below the vocabulary size
        (not checked here: the executor checks them when a request comes).
        One host-to-device copy, none when nothing is banned."""
        rows = [row for row, ids in banned for _ in ids]
        if not rows:
            if not self.num_banned:
                return self
            empty = self.banned_rows[:0]
            return replace(self, banned_rows=empty, banned_ids=empty, num_banned=0)
        ids = [token for _, row_ids in banned for token in row_ids]
        pairs = _to_device(torch.tensor([rows, ids], dtype=torch.int64), self.temperature.device)
        return replace(self, banned_rows=pairs[0], banned_ids=pairs[1], num_banned=len(rows))


class SamplerOutput(NamedTuple):
    """Per row: the sampled token and raw-distribution logprobs."""

    token_ids: Tensor  # int64 [N]
    logprobs: Tensor  # float32 [N]: raw log-prob of token_ids
    top_token_ids: Tensor  # int64 [N, K]: most likely raw tokens, most likely first
    top_logprobs: Tensor  # float32 [N, K]


def sample(
    logits: Tensor, params: SamplingParamsBatch, generator: torch.Generator | None = None
) -> SamplerOutput:
    """Sample one token per row of ``logits`` (float32 ``[N, vocab_size]``).

    Reads ``logits`` without changing them. Draws from ``generator`` (the
    device's default generator when None) only if
    ``params.any_unseeded_random``. Raises ValueError on shapes, dtypes or
    devices that do not match ``params``.
    """
    _check_inputs(logits, params)
    log_normaliser = logits.logsumexp(dim=-1, keepdim=True)
    allowed = logits  # what a token is chosen from
    if params.num_banned:
        never = torch.full((), -math.inf, dtype=logits.dtype, device=logits.device)
        allowed = logits.index_put((params.banned_rows, params.banned_ids), never)
    if params.all_greedy:  # the max and its first index in one pass
        max_logits, token_ids = allowed.max(dim=-1)  # a chosen token is not banned
        logprobs = max_logits - log_normaliser.squeeze(1)
    else:
        greedy_ids = allowed.argmax(dim=-1)
        random_ids = _sample_random(allowed, params, generator)
        token_ids = torch.where(params.temperature == 0, greedy_ids, random_ids)
        logprobs = (logits.gather(1, token_ids[:, None]) - log_normaliser).squeeze(1)
    if params.max_num_logprobs:
        top_logits, top_token_ids = logits.topk(params.max_num_logprobs, dim=-1)
        top_logprobs = top_logits - log_normaliser
    else:
        top_token_ids = torch.empty((logits.shape[0], 0), dtype=torch.int64, device=logits.device)
        top_logprobs = torch.empty((logits.shape[0], 0), dtype=logits.dtype, device=logits.device)
    return SamplerOutput(token_ids, logprobs, top_token_ids, top_logprobs)


def seeded_exponentials(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Exp(1) noise, float32 ``[S, vocab_size]``, for int64 ``seeds`` and ``positions`` ``[S]``.

    Entry ``(i, t)`` is ``-ln((h + 0.5) / 2**32)`` with ``h`` the MurmurHash3_x86_32
    of the words (seed low, seed high, position low, position high, ``t``): a
    function of ``(seeds[i], positions[i], t)`` alone, the same on every device.
    """
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    words = [
        (seeds & _MASK32)[:, None],
        ((seeds >> 32) & _MASK32)[:, None],
        (positions & _MASK32)[:, None],
        ((positions >> 32) & _MASK32)[:, None],
        token_ids[None, :],
    ]
    uniform = murmur3_32(words).to(torch.float64).add_(0.5).mul_(2.0**-32)
    return uniform.log_().neg_().to(torch.float32)


def murmur3_32(words: Sequence[Tensor], seed: int = 0) -> Tensor:
    """MurmurHash3_x86_32 of ``4 * len(words)`` bytes: the words as little-endian uint32.

    Each word is an int64 tensor of values in ``[0, 2**32)`` (left unchanged);
    the words are broadcast together and the result (int64, in ``[0, 2**32)``)
    has their broadcast shape. Exact in int64 arithmetic: no intermediate
    reaches ``2**49``. Past the last word's broadcast, at most two tensors of
    the result's size are alive at once.
    """
    assert words, "murmur3_32 needs at least one word"
    h = torch.full((), seed & _MASK32, dtype=torch.int64, device=words[0].device)
    for word in words:
        k = _mul32_(_rotl32(_mul32_(word.clone(), 0xCC9E2D51), 15), 0x1B873593)
        h = _rotl32(h ^ k, 13)
        h *= 5
        h += 0xE6546B64
        h &= _MASK32
    h = h ^ (4 * len(words))
    h ^= h >> 16
    _mul32_(h, 0x85EBCA6B)
    h ^= h >> 13
    _mul32_(h, 0xC2B2AE35)
    h ^= h >> 16
    return h


def _mul32_(x: Tensor, constant: int) -> Tensor:
    """In place: ``x * constant mod 2**32`` for ``x`` in ``[0, 2**32)``, by 16-bit halves."""
    high = x * (constant >> 16)
    high &= 0xFFFF
    high <<= 16
    x *= constant & 0xFFFF
    x += high
    x &= _MASK32
    return x


def _rotl32(x: Tensor, bits: int) -> Tensor:
    """``x`` rotated left by ``bits`` as a uint32, in a new tensor."""
    rotated = x << bits
    rotated |= x >> (32 - bits)
    rotated &= _MASK32
    return rotated


def _sample_random(
    logits: Tensor, params: SamplingParamsBatch, generator: torch.Generator | None
) -> Tensor:
    """Random rows' tokens; greedy rows get some token that the caller discards."""
    temperature = torch.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    if params.any_top_p:
        scaled = _apply_top_k_top_p(scaled, params)
    elif params.any_top_k:
        scaled = _apply_top_k(scaled, params.top_k, params.max_top_k)
    probs = scaled.softmax(dim=-1)
    return probs.div_(_exponentials(params, probs.shape[1], generator)).argmax(dim=-1)


def _apply_top_k(scaled: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    """Logits below each row's ``top_k``-th largest set to -inf (rows with 0 kept whole)."""
    num_kept = min(max_top_k, scaled.shape[1])
    largest = scaled.topk(num_kept, dim=-1).values
    threshold = largest.gather(1, (top_k.clamp(1, num_kept) - 1)[:, None])
    threshold = threshold.masked_fill((top_k == 0)[:, None], -math.inf)
    return scaled.masked_fill(scaled < threshold, -math.inf)


def _apply_top_k_top_p(scaled: Tensor, params: SamplingParamsBatch) -> Tensor:
    """Top-k then nucleus filtering (as -inf logits), on one stable descending sort."""
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    if params.any_top_k:
        top_k = params.top_k
        index = (top_k.clamp(1, scaled.shape[1]) - 1)[:, None]
        threshold = sorted_logits.gather(1, index).masked_fill((top_k == 0)[:, None], -math.inf)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, -math.inf)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (mass_before >= params.top_p[:, None]) & (params.top_p < 1.0)[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    return torch.empty_like(scaled).scatter_(1, sorted_ids, sorted_logits)


def _exponentials(
    params: SamplingParamsBatch, vocab_size: int, generator: torch.Generator | None
) -> Tensor:
    """Exp(1) noise ``[N, vocab_size]``: the generator's, seeded rows' replaced by their hash."""
    shape = (params.num_rows, vocab_size)
    device = params.temperature.device
    if params.any_unseeded_random:
        noise = torch.empty(shape, dtype=torch.float32, device=device)
        # A draw of exactly 0 would turn a 0-probability token's 0/0 into a NaN winner.
        noise.exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    else:
        noise = torch.ones(shape, dtype=torch.float32, device=device)
    if params.any_seeded:
        rows = params.seeded_rows
        seeded = seeded_exponentials(params.seeds[rows], params.positions[rows], vocab_size)
        noise.index_copy_(0, rows, seeded)
    return noise


def _check_inputs(logits: Tensor, params: SamplingParamsBatch) -> None:
    if logits.ndim != 2 or logits.dtype != torch.float32:
        raise ValueError(
            f"logits: expected float32 [N, vocab_size], got {logits.dtype} {list(logits.shape)}"
        )
    num_rows, vocab_size = logits.shape
    if num_rows != params.num_rows:
        raise ValueError(f"logits: {num_rows} rows for {params.num_rows} rows of params")
    if vocab_size == 0:
        raise ValueError("logits: the vocabulary is empty")
    if params.max_num_logprobs > vocab_size:
        raise ValueError(
            f"max_num_logprobs: {params.max_num_logprobs} exceeds the vocabulary ({vocab_size})"
        )
    if params.temperature.device != logits.device:
        raise ValueError(f"params: on {params.temperature.device}, logits on {logits.device}")


def _check_temperature(row: int, temperature: float) -> float:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature[{row}]: {temperature} is not a finite value >= 0")
    return 0.0 if temperature < MIN_TEMPERATURE else float(temperature)


def _check_row(row: int, top_k: int, top_p: float, seed: int | None) -> None:
    if not 0 <= top_k < _MAX_TOP_K:
        raise ValueError(f"top_k[{row}]: {top_k} is not in [0, 2**32)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p[{row}]: {top_p} is not in (0, 1]")
    if seed is not None and not 0 <= seed < _MAX_SEED:
        raise ValueError(f"seeds[{row}]: {seed} is not in [0, 2**64)")


def _to_device(host: Tensor, device: torch.device | str) -> Tensor:
    """``host`` on ``device``; to CUDA through pinned memory, so the host does not wait."""
    if host.device.type == "cpu" and torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _to_int64(seed: int) -> int:
    """The uint64 ``seed`` as the int64 with the same bits."""
    return seed - _MAX_SEED if seed >= _MAX_SEED // 2 else seed
