from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "beam_width", "stop_token_ids", "ignore_eos", "logprobs", "stop", "include_stop_str_in_output", "min_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    n: int
    beam_width: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    min_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., beam_width: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class Owner(_message.Message):
    __slots__ = ("owner_id", "epoch")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    epoch: int
    def __init__(self, owner_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class KVCacheSpec(_message.Message):
    __slots__ = ("block_size", "layer_indices", "num_kv_heads", "head_size", "dtype", "sliding_window", "page_size_bytes")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_INDICES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    layer_indices: _containers.RepeatedScalarFieldContainer[int]
    num_kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int
    page_size_bytes: int
    def __init__(self, block_size: _Optional[int] = ..., layer_indices: _Optional[_Iterable[int]] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ..., sliding_window: _Optional[int] = ..., page_size_bytes: _Optional[int] = ...) -> None: ...
