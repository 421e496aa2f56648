from pagedkv.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class PlacementHint(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_HINT_NONE: _ClassVar[PlacementHint]
    PLACEMENT_HINT_HONOURED: _ClassVar[PlacementHint]
    PLACEMENT_HINT_NOT_HELD: _ClassVar[PlacementHint]
    PLACEMENT_HINT_DRAINING: _ClassVar[PlacementHint]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
PLACEMENT_HINT_NONE: PlacementHint
PLACEMENT_HINT_HONOURED: PlacementHint
PLACEMENT_HINT_NOT_HELD: PlacementHint
PLACEMENT_HINT_DRAINING: PlacementHint

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "cache_salt", "priority", "resumed_token_ids", "preferred_executor", "skip_text")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    SKIP_TEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    priority: int
    resumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    preferred_executor: str
    skip_text: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., resumed_token_ids: _Optional[_Iterable[int]] = ..., preferred_executor: _Optional[str] = ..., skip_text: _Optional[bool] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("index", "token_ids", "text_delta", "logprobs", "finish_reason", "stop_token_id", "error_message", "stop_string")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: FinishReason
    stop_token_id: int
    error_message: str
    stop_string: str
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., error_message: _Optional[str] = ..., stop_string: _Optional[str] = ...) -> None: ...

class BeamOutput(_message.Message):
    __slots__ = ("token_ids", "text", "cumulative_logprob", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    cumulative_logprob: float
    finish_reason: FinishReason
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., cumulative_logprob: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("executor", "hint")
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    executor: str
    hint: PlacementHint
    def __init__(self, executor: _Optional[str] = ..., hint: _Optional[_Union[PlacementHint, str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "outputs", "beams", "usage", "placement")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    BEAMS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outputs: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    beams: _containers.RepeatedCompositeFieldContainer[BeamOutput]
    usage: Usage
    placement: Placement
    def __init__(self, request_id: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., beams: _Optional[_Iterable[_Union[BeamOutput, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("reset_peak_used_blocks",)
    RESET_PEAK_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    reset_peak_used_blocks: bool
    def __init__(self, reset_peak_used_blocks: _Optional[bool] = ...) -> None: ...

class IntegrityCheck(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class ExecutorStats(_message.Message):
    __slots__ = ("address", "healthy", "num_blocks", "num_free_blocks", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "incarnation_id", "epoch", "num_usable_blocks", "suspect", "down_reason", "num_recoveries", "draining", "num_adopted_cached_blocks", "num_host_blocks", "num_cached_host_blocks", "prefix_cache_host_hits", "num_offloaded_blocks", "num_loaded_blocks", "host_loads_chosen", "host_recomputes_chosen", "prefill_seconds_per_token", "host_load_seconds", "host_load_seconds_per_block", "offloaded_bytes", "loaded_bytes", "offload_copy_seconds", "load_copy_seconds", "kv_cache_dtype", "bytes_per_block", "peak_used_blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_USABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    DOWN_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_ADOPTED_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HOST_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_LOADS_CHOSEN_FIELD_NUMBER: _ClassVar[int]
    HOST_RECOMPUTES_CHOSEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOST_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOST_LOAD_SECONDS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_COPY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_COPY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PEAK_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    healthy: bool
    num_blocks: int
    num_free_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    incarnation_id: str
    epoch: int
    num_usable_blocks: int
    suspect: bool
    down_reason: str
    num_recoveries: int
    draining: bool
    num_adopted_cached_blocks: int
    num_host_blocks: int
    num_cached_host_blocks: int
    prefix_cache_host_hits: int
    num_offloaded_blocks: int
    num_loaded_blocks: int
    host_loads_chosen: int
    host_recomputes_chosen: int
    prefill_seconds_per_token: float
    host_load_seconds: float
    host_load_seconds_per_block: float
    offloaded_bytes: int
    loaded_bytes: int
    offload_copy_seconds: float
    load_copy_seconds: float
    kv_cache_dtype: str
    bytes_per_block: int
    peak_used_blocks: int
    def __init__(self, address: _Optional[str] = ..., healthy: _Optional[bool] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., incarnation_id: _Optional[str] = ..., epoch: _Optional[int] = ..., num_usable_blocks: _Optional[int] = ..., suspect: _Optional[bool] = ..., down_reason: _Optional[str] = ..., num_recoveries: _Optional[int] = ..., draining: _Optional[bool] = ..., num_adopted_cached_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., num_cached_host_blocks: _Optional[int] = ..., prefix_cache_host_hits: _Optional[int] = ..., num_offloaded_blocks: _Optional[int] = ..., num_loaded_blocks: _Optional[int] = ..., host_loads_chosen: _Optional[int] = ..., host_recomputes_chosen: _Optional[int] = ..., prefill_seconds_per_token: _Optional[float] = ..., host_load_seconds: _Optional[float] = ..., host_load_seconds_per_block: _Optional[float] = ..., offloaded_bytes: _Optional[int] = ..., loaded_bytes: _Optional[int] = ..., offload_copy_seconds: _Optional[float] = ..., load_copy_seconds: _Optional[float] = ..., kv_cache_dtype: _Optional[str] = ..., bytes_per_block: _Optional[int] = ..., peak_used_blocks: _Optional[int] = ...) -> None: ...

class ClusterExecutor(_message.Message):
    __slots__ = ("address", "incarnation_id", "owner_id", "epoch")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    address: str
    incarnation_id: str
    owner_id: str
    epoch: int
    def __init__(self, address: _Optional[str] = ..., incarnation_id: _Optional[str] = ..., owner_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ClusterState(_message.Message):
    __slots__ = ("enabled", "degraded", "detail", "scheduler_ids", "executors")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_IDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    degraded: bool
    detail: str
    scheduler_ids: _containers.RepeatedScalarFieldContainer[str]
    executors: _containers.RepeatedCompositeFieldContainer[ClusterExecutor]
    def __init__(self, enabled: _Optional[bool] = ..., degraded: _Optional[bool] = ..., detail: _Optional[str] = ..., scheduler_ids: _Optional[_Iterable[str]] = ..., executors: _Optional[_Iterable[_Union[ClusterExecutor, _Mapping]]] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("executors", "num_running", "num_waiting", "num_preemptions", "integrity", "scheduler_id", "num_internal_errors", "cluster", "draining", "router")
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_INTERNAL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorStats]
    num_running: int
    num_waiting: int
    num_preemptions: int
    integrity: IntegrityCheck
    scheduler_id: str
    num_internal_errors: int
    cluster: ClusterState
    draining: bool
    router: RouterState
    def __init__(self, executors: _Optional[_Iterable[_Union[ExecutorStats, _Mapping]]] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., integrity: _Optional[_Union[IntegrityCheck, _Mapping]] = ..., scheduler_id: _Optional[str] = ..., num_internal_errors: _Optional[int] = ..., cluster: _Optional[_Union[ClusterState, _Mapping]] = ..., draining: _Optional[bool] = ..., router: _Optional[_Union[RouterState, _Mapping]] = ...) -> None: ...

class RouterState(_message.Message):
    __slots__ = ("router_id", "unreachable_scheduler_ids", "num_indexed_blocks", "num_followed_executors", "kv_event_lag_seconds", "policy")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_SCHEDULER_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FOLLOWED_EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENT_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    unreachable_scheduler_ids: _containers.RepeatedScalarFieldContainer[str]
    num_indexed_blocks: int
    num_followed_executors: int
    kv_event_lag_seconds: float
    policy: str
    def __init__(self, router_id: _Optional[str] = ..., unreachable_scheduler_ids: _Optional[_Iterable[str]] = ..., num_indexed_blocks: _Optional[int] = ..., num_followed_executors: _Optional[int] = ..., kv_event_lag_seconds: _Optional[float] = ..., policy: _Optional[str] = ...) -> None: ...
