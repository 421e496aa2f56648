from pagedkv.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model_id", "dtype", "max_model_len", "vocab_size", "eos_token_ids", "block_size", "num_blocks", "bytes_per_block", "kv_cache_groups", "incarnation_id", "owner", "max_num_rows", "max_num_batched_tokens", "max_logprobs", "device", "num_tagged_blocks", "draining", "num_host_blocks", "prefill_seconds_per_token", "host_load_seconds", "host_load_seconds_per_block")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_TAGGED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOST_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOST_LOAD_SECONDS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    num_blocks: int
    bytes_per_block: int
    kv_cache_groups: _containers.RepeatedCompositeFieldContainer[_common_pb2.KVCacheSpec]
    incarnation_id: str
    owner: _common_pb2.Owner
    max_num_rows: int
    max_num_batched_tokens: int
    max_logprobs: int
    device: str
    num_tagged_blocks: int
    draining: bool
    num_host_blocks: int
    prefill_seconds_per_token: float
    host_load_seconds: float
    host_load_seconds_per_block: float
    def __init__(self, model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., kv_cache_groups: _Optional[_Iterable[_Union[_common_pb2.KVCacheSpec, _Mapping]]] = ..., incarnation_id: _Optional[str] = ..., owner: _Optional[_Union[_common_pb2.Owner, _Mapping]] = ..., max_num_rows: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_logprobs: _Optional[int] = ..., device: _Optional[str] = ..., num_tagged_blocks: _Optional[int] = ..., draining: _Optional[bool] = ..., num_host_blocks: _Optional[int] = ..., prefill_seconds_per_token: _Optional[float] = ..., host_load_seconds: _Optional[float] = ..., host_load_seconds_per_block: _Optional[float] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("seq_id", "row", "prompt_token_ids", "sampling", "num_prompt_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    row: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    num_prompt_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., row: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("owner", "step_id", "new_requests", "rows", "num_scheduled_tokens", "num_computed_tokens", "token_ids", "continue_from_sampled", "needs_sample", "block_table_starts", "new_block_counts", "new_block_ids", "freed_rows", "copy_src_block_ids", "copy_dst_block_ids", "untag_block_ids", "tag_block_ids", "tag_block_hashes", "tag_group_ids", "num_decode_steps", "offload_block_ids", "offload_host_block_ids", "load_host_block_ids", "load_block_ids")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FROM_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    NEEDS_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_STARTS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FREED_ROWS_FIELD_NUMBER: _ClassVar[int]
    COPY_SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    UNTAG_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TAG_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TAG_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAG_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_HOST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_HOST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    owner: _common_pb2.Owner
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    rows: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    continue_from_sampled: _containers.RepeatedScalarFieldContainer[bool]
    needs_sample: _containers.RepeatedScalarFieldContainer[bool]
    block_table_starts: _containers.RepeatedScalarFieldContainer[int]
    new_block_counts: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    freed_rows: _containers.RepeatedScalarFieldContainer[int]
    copy_src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    copy_dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    untag_block_ids: _containers.RepeatedScalarFieldContainer[int]
    tag_block_ids: _containers.RepeatedScalarFieldContainer[int]
    tag_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tag_group_ids: _containers.RepeatedScalarFieldContainer[int]
    num_decode_steps: int
    offload_block_ids: _containers.RepeatedScalarFieldContainer[int]
    offload_host_block_ids: _containers.RepeatedScalarFieldContainer[int]
    load_host_block_ids: _containers.RepeatedScalarFieldContainer[int]
    load_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, owner: _Optional[_Union[_common_pb2.Owner, _Mapping]] = ..., step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., rows: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., continue_from_sampled: _Optional[_Iterable[bool]] = ..., needs_sample: _Optional[_Iterable[bool]] = ..., block_table_starts: _Optional[_Iterable[int]] = ..., new_block_counts: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., freed_rows: _Optional[_Iterable[int]] = ..., copy_src_block_ids: _Optional[_Iterable[int]] = ..., copy_dst_block_ids: _Optional[_Iterable[int]] = ..., untag_block_ids: _Optional[_Iterable[int]] = ..., tag_block_ids: _Optional[_Iterable[int]] = ..., tag_block_hashes: _Optional[_Iterable[bytes]] = ..., tag_group_ids: _Optional[_Iterable[int]] = ..., num_decode_steps: _Optional[int] = ..., offload_block_ids: _Optional[_Iterable[int]] = ..., offload_host_block_ids: _Optional[_Iterable[int]] = ..., load_host_block_ids: _Optional[_Iterable[int]] = ..., load_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "sampled_rows", "sampled_token_ids", "sampled_logprobs", "num_top_logprobs", "top_token_ids", "top_logprobs", "host_time_us", "device_time_us", "draining", "drain_seconds_left", "host_offload_time_us", "host_load_time_us")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_ROWS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIME_US_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TIME_US_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DRAIN_SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    HOST_OFFLOAD_TIME_US_FIELD_NUMBER: _ClassVar[int]
    HOST_LOAD_TIME_US_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_rows: _containers.RepeatedScalarFieldContainer[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_top_logprobs: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    host_time_us: int
    device_time_us: int
    draining: bool
    drain_seconds_left: float
    host_offload_time_us: int
    host_load_time_us: int
    def __init__(self, step_id: _Optional[int] = ..., sampled_rows: _Optional[_Iterable[int]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., sampled_logprobs: _Optional[_Iterable[float]] = ..., num_top_logprobs: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., host_time_us: _Optional[int] = ..., device_time_us: _Optional[int] = ..., draining: _Optional[bool] = ..., drain_seconds_left: _Optional[float] = ..., host_offload_time_us: _Optional[int] = ..., host_load_time_us: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("owner", "new_requests", "rows", "block_table_starts", "new_block_counts", "new_block_ids")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_STARTS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    owner: _common_pb2.Owner
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    rows: _containers.RepeatedScalarFieldContainer[int]
    block_table_starts: _containers.RepeatedScalarFieldContainer[int]
    new_block_counts: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, owner: _Optional[_Union[_common_pb2.Owner, _Mapping]] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., rows: _Optional[_Iterable[int]] = ..., block_table_starts: _Optional[_Iterable[int]] = ..., new_block_counts: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("owner", "rows", "seq_ids")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    owner: _common_pb2.Owner
    rows: _containers.RepeatedScalarFieldContainer[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, owner: _Optional[_Union[_common_pb2.Owner, _Mapping]] = ..., rows: _Optional[_Iterable[int]] = ..., seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("freed_rows",)
    FREED_ROWS_FIELD_NUMBER: _ClassVar[int]
    freed_rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, freed_rows: _Optional[_Iterable[int]] = ...) -> None: ...

class CopyBlocksRequest(_message.Message):
    __slots__ = ("owner", "src_block_ids", "dst_block_ids")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    owner: _common_pb2.Owner
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, owner: _Optional[_Union[_common_pb2.Owner, _Mapping]] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CopyBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("owner", "drop_cached_blocks")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    DROP_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    owner: _common_pb2.Owner
    drop_cached_blocks: bool
    def __init__(self, owner: _Optional[_Union[_common_pb2.Owner, _Mapping]] = ..., drop_cached_blocks: _Optional[bool] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("previous_owner", "incarnation_id")
    PREVIOUS_OWNER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    previous_owner: _common_pb2.Owner
    incarnation_id: str
    def __init__(self, previous_owner: _Optional[_Union[_common_pb2.Owner, _Mapping]] = ..., incarnation_id: _Optional[str] = ...) -> None: ...

class ListCachedBlocksRequest(_message.Message):
    __slots__ = ("owner",)
    OWNER_FIELD_NUMBER: _ClassVar[int]
    owner: _common_pb2.Owner
    def __init__(self, owner: _Optional[_Union[_common_pb2.Owner, _Mapping]] = ...) -> None: ...

class ListCachedBlocksResponse(_message.Message):
    __slots__ = ("block_ids", "block_hashes", "group_ids", "host_block_ids", "host_block_hashes", "host_group_ids")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HOST_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    group_ids: _containers.RepeatedScalarFieldContainer[int]
    host_block_ids: _containers.RepeatedScalarFieldContainer[int]
    host_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    host_group_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., group_ids: _Optional[_Iterable[int]] = ..., host_block_ids: _Optional[_Iterable[int]] = ..., host_block_hashes: _Optional[_Iterable[bytes]] = ..., host_group_ids: _Optional[_Iterable[int]] = ...) -> None: ...
