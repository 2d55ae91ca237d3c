from mesh_api.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "adapter_id", "sampling", "predicted_output_tokens", "first_token_deadline_ms", "resumed_output_tokens", "prefix_cache_namespace")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter_id: str
    sampling: _types_pb2.SamplingParams
    predicted_output_tokens: int
    first_token_deadline_ms: float
    resumed_output_tokens: int
    prefix_cache_namespace: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., adapter_id: _Optional[str] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., predicted_output_tokens: _Optional[int] = ..., first_token_deadline_ms: _Optional[float] = ..., resumed_output_tokens: _Optional[int] = ..., prefix_cache_namespace: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "timings", "request_id", "logprobs", "migrated_to", "cached_prompt_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_TO_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _types_pb2.FinishReason
    timings: _types_pb2.Timings
    request_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprobs]
    migrated_to: str
    cached_prompt_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., timings: _Optional[_Union[_types_pb2.Timings, _Mapping]] = ..., request_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprobs, _Mapping]]] = ..., migrated_to: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id",)
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    def __init__(self, adapter_id: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter_id", "rank", "bytes", "was_resident")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WAS_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    rank: int
    bytes: int
    was_resident: bool
    def __init__(self, adapter_id: _Optional[str] = ..., rank: _Optional[int] = ..., bytes: _Optional[int] = ..., was_resident: _Optional[bool] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("adapter_ids",)
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    adapter_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("started",)
    STARTED_FIELD_NUMBER: _ClassVar[int]
    started: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, started: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatsResponse(_message.Message):
    __slots__ = ("queue", "running", "free_pages", "total_pages", "kv_pages", "adapter_pages", "resident_adapters", "tokens_per_s", "preemptions", "model", "dtype", "dgfm_recalls", "dgfm_blocks_recalled", "kv_manager_term", "leader_writes_accepted", "leader_writes_refused")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DGFM_RECALLS_FIELD_NUMBER: _ClassVar[int]
    DGFM_BLOCKS_RECALLED_FIELD_NUMBER: _ClassVar[int]
    KV_MANAGER_TERM_FIELD_NUMBER: _ClassVar[int]
    LEADER_WRITES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LEADER_WRITES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    queue: int
    running: int
    free_pages: int
    total_pages: int
    kv_pages: int
    adapter_pages: int
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    tokens_per_s: float
    preemptions: int
    model: str
    dtype: str
    dgfm_recalls: int
    dgfm_blocks_recalled: int
    kv_manager_term: int
    leader_writes_accepted: int
    leader_writes_refused: int
    def __init__(self, queue: _Optional[int] = ..., running: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., kv_pages: _Optional[int] = ..., adapter_pages: _Optional[int] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., tokens_per_s: _Optional[float] = ..., preemptions: _Optional[int] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., dgfm_recalls: _Optional[int] = ..., dgfm_blocks_recalled: _Optional[int] = ..., kv_manager_term: _Optional[int] = ..., leader_writes_accepted: _Optional[int] = ..., leader_writes_refused: _Optional[int] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestLoad(_message.Message):
    __slots__ = ("request_id", "adapter_id", "context_tokens", "remaining_tokens", "running", "waited_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter_id: str
    context_tokens: int
    remaining_tokens: int
    running: bool
    waited_s: float
    def __init__(self, request_id: _Optional[str] = ..., adapter_id: _Optional[str] = ..., context_tokens: _Optional[int] = ..., remaining_tokens: _Optional[int] = ..., running: _Optional[bool] = ..., waited_s: _Optional[float] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests", "memory_tokens", "free_tokens", "max_running", "held_adapters", "adapter_tokens")
    class AdapterTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    HELD_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestLoad]
    memory_tokens: int
    free_tokens: int
    max_running: int
    held_adapters: _containers.RepeatedScalarFieldContainer[str]
    adapter_tokens: _containers.ScalarMap[str, int]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestLoad, _Mapping]]] = ..., memory_tokens: _Optional[int] = ..., free_tokens: _Optional[int] = ..., max_running: _Optional[int] = ..., held_adapters: _Optional[_Iterable[str]] = ..., adapter_tokens: _Optional[_Mapping[str, int]] = ...) -> None: ...

class HandOffRequest(_message.Message):
    __slots__ = ("request_id", "target_worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target_worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., target_worker_id: _Optional[str] = ...) -> None: ...

class HandOffResponse(_message.Message):
    __slots__ = ("generated_tokens",)
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    generated_tokens: int
    def __init__(self, generated_tokens: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class KvBlockLayout(_message.Message):
    __slots__ = ("kv_block_tokens", "num_layers", "kv_dim")
    KV_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_DIM_FIELD_NUMBER: _ClassVar[int]
    kv_block_tokens: int
    num_layers: int
    kv_dim: int
    def __init__(self, kv_block_tokens: _Optional[int] = ..., num_layers: _Optional[int] = ..., kv_dim: _Optional[int] = ...) -> None: ...

class AllocateBlocksRequest(_message.Message):
    __slots__ = ("debtor", "count", "layout")
    DEBTOR_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    debtor: str
    count: int
    layout: KvBlockLayout
    def __init__(self, debtor: _Optional[str] = ..., count: _Optional[int] = ..., layout: _Optional[_Union[KvBlockLayout, _Mapping]] = ...) -> None: ...

class AllocateBlocksResponse(_message.Message):
    __slots__ = ("block_ids", "layout")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    layout: KvBlockLayout
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[KvBlockLayout, _Mapping]] = ...) -> None: ...

class WriteKvRequest(_message.Message):
    __slots__ = ("debtor", "layer", "block_ids", "slots", "keys", "values")
    DEBTOR_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    debtor: str
    layer: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slots: Tensor
    keys: Tensor
    values: Tensor
    def __init__(self, debtor: _Optional[str] = ..., layer: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., slots: _Optional[_Union[Tensor, _Mapping]] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class WriteKvResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FreeBlocksRequest(_message.Message):
    __slots__ = ("debtor", "block_ids")
    DEBTOR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    debtor: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, debtor: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoteAttendSegment(_message.Message):
    __slots__ = ("queries", "query_positions", "block_ids", "block_first_positions")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    QUERY_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIRST_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    queries: Tensor
    query_positions: Tensor
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_first_positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, queries: _Optional[_Union[Tensor, _Mapping]] = ..., query_positions: _Optional[_Union[Tensor, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_first_positions: _Optional[_Iterable[int]] = ...) -> None: ...

class AttendRemoteRequest(_message.Message):
    __slots__ = ("debtor", "layer", "segments", "write")
    DEBTOR_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    WRITE_FIELD_NUMBER: _ClassVar[int]
    debtor: str
    layer: int
    segments: _containers.RepeatedCompositeFieldContainer[RemoteAttendSegment]
    write: KvRows
    def __init__(self, debtor: _Optional[str] = ..., layer: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[RemoteAttendSegment, _Mapping]]] = ..., write: _Optional[_Union[KvRows, _Mapping]] = ...) -> None: ...

class KvRows(_message.Message):
    __slots__ = ("block_ids", "slots", "keys", "values")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slots: Tensor
    keys: Tensor
    values: Tensor
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., slots: _Optional[_Union[Tensor, _Mapping]] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RemotePartialAttention(_message.Message):
    __slots__ = ("output", "lse")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    lse: Tensor
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., lse: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class AttendRemoteResponse(_message.Message):
    __slots__ = ("partials",)
    PARTIALS_FIELD_NUMBER: _ClassVar[int]
    partials: _containers.RepeatedCompositeFieldContainer[RemotePartialAttention]
    def __init__(self, partials: _Optional[_Iterable[_Union[RemotePartialAttention, _Mapping]]] = ...) -> None: ...

class OpenLendingLaneRequest(_message.Message):
    __slots__ = ("debtor",)
    DEBTOR_FIELD_NUMBER: _ClassVar[int]
    debtor: str
    def __init__(self, debtor: _Optional[str] = ...) -> None: ...

class OpenLendingLaneResponse(_message.Message):
    __slots__ = ("path", "token", "tcp_port")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    path: str
    token: str
    tcp_port: int
    def __init__(self, path: _Optional[str] = ..., token: _Optional[str] = ..., tcp_port: _Optional[int] = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("debtor", "block_ids")
    DEBTOR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    debtor: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, debtor: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReadBlocksResponse(_message.Message):
    __slots__ = ("keys", "values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: Tensor
    values: Tensor
    def __init__(self, keys: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RecallBlocksRequest(_message.Message):
    __slots__ = ("holder", "blocks", "leader")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    holder: str
    blocks: int
    leader: _types_pb2.LeaderTerm
    def __init__(self, holder: _Optional[str] = ..., blocks: _Optional[int] = ..., leader: _Optional[_Union[_types_pb2.LeaderTerm, _Mapping]] = ...) -> None: ...

class RecallBlocksResponse(_message.Message):
    __slots__ = ("blocks_moved",)
    BLOCKS_MOVED_FIELD_NUMBER: _ClassVar[int]
    blocks_moved: int
    def __init__(self, blocks_moved: _Optional[int] = ...) -> None: ...

class StageOutBlocksRequest(_message.Message):
    __slots__ = ("holder", "blocks", "leader")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    holder: str
    blocks: int
    leader: _types_pb2.LeaderTerm
    def __init__(self, holder: _Optional[str] = ..., blocks: _Optional[int] = ..., leader: _Optional[_Union[_types_pb2.LeaderTerm, _Mapping]] = ...) -> None: ...

class StageOutBlocksResponse(_message.Message):
    __slots__ = ("stage_id",)
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    stage_id: int
    def __init__(self, stage_id: _Optional[int] = ...) -> None: ...

class StageInBlocksRequest(_message.Message):
    __slots__ = ("stage_id", "leader")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    stage_id: int
    leader: _types_pb2.LeaderTerm
    def __init__(self, stage_id: _Optional[int] = ..., leader: _Optional[_Union[_types_pb2.LeaderTerm, _Mapping]] = ...) -> None: ...

class StageInBlocksResponse(_message.Message):
    __slots__ = ("blocks_home",)
    BLOCKS_HOME_FIELD_NUMBER: _ClassVar[int]
    blocks_home: int
    def __init__(self, blocks_home: _Optional[int] = ...) -> None: ...

class FetchPrefixBlocksRequest(_message.Message):
    __slots__ = ("kv_identity", "keys")
    KV_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    kv_identity: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, kv_identity: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class FetchPrefixBlocksResponse(_message.Message):
    __slots__ = ("key", "kv")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    kv: Tensor
    def __init__(self, key: _Optional[bytes] = ..., kv: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
