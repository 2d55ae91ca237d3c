from loramesh.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "adapter_id", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter_id: str
    sampling: _types_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., adapter_id: _Optional[str] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "timings", "request_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _types_pb2.FinishReason
    timings: _types_pb2.Timings
    request_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., timings: _Optional[_Union[_types_pb2.Timings, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("queue", "running", "free_pages", "total_pages", "kv_pages", "adapter_pages", "resident_adapters", "tokens_per_s", "preemptions", "model", "dtype")
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
    def __init__(self, queue: _Optional[int] = ..., running: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., kv_pages: _Optional[int] = ..., adapter_pages: _Optional[int] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., tokens_per_s: _Optional[float] = ..., preemptions: _Optional[int] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...
