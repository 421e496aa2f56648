"""What the executor says of itself in GetInfo (``info_response``).

The model (its id, dtype, lengths, vocabulary and EOS tokens), the KV
memory (block size and count, bytes per block, its cache groups, the host
tier's blocks), the limits a step must keep (rows, batched tokens,
logprobs), the incarnation and its owner, and the host tier's measured
costs (zero until measured). Built from the runner and the engine's state
as the engine reads it; builds the message and changes nothing.
"""

from __future__ import annotations

from pagedkv.executor.host_costs import HostCosts
from pagedkv.executor.model_runner import ModelRunner
from pagedkv.v1 import common_pb2, executor_pb2


def info_response(
    runner: ModelRunner,
    model_id: str,
    incarnation_id: str,
    owner: common_pb2.Owner,
    num_tagged_blocks: int,
    draining: bool,
) -> executor_pb2.GetInfoResponse:
    """The GetInfo answer of an executor running ``runner``: ``owner`` is the
    current one, ``num_tagged_blocks`` its block tags' count, ``draining``
    whether it is stopping."""
    spec = runner.spec
    costs = runner.host_costs or HostCosts(0.0, 0.0, 0.0)
    return executor_pb2.GetInfoResponse(
        model_id=model_id,
        dtype=str(runner.dtype).removeprefix("torch."),
        max_model_len=spec.max_model_len,
        vocab_size=spec.vocab_size,
        eos_token_ids=spec.eos_token_ids,
        block_size=runner.config.block_size,
        num_blocks=runner.limits.num_blocks,
        bytes_per_block=runner.bytes_per_block,
        kv_cache_groups=[group.to_proto() for group in runner.groups],
        incarnation_id=incarnation_id,
        owner=owner,
        max_num_rows=runner.config.max_num_rows,
        max_num_batched_tokens=runner.config.max_num_batched_tokens,
        max_logprobs=runner.config.max_logprobs,
        device=str(runner.device),
        num_tagged_blocks=num_tagged_blocks,
        draining=draining,
        num_host_blocks=runner.limits.num_host_blocks,
        prefill_seconds_per_token=costs.prefill_seconds_per_token,
        host_load_seconds=costs.load_seconds,
        host_load_seconds_per_block=costs.load_seconds_per_block,
    )
