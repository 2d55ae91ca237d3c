from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlaceRequest(_message.Message):
    __slots__ = ("request_id", "adapter_id", "prompt_tokens", "max_tokens", "first_token_deadline_ms", "exclude_workers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter_id: str
    prompt_tokens: int
    max_tokens: int
    first_token_deadline_ms: float
    exclude_workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., adapter_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., first_token_deadline_ms: _Optional[float] = ..., exclude_workers: _Optional[_Iterable[str]] = ...) -> None: ...

class PlaceResponse(_message.Message):
    __slots__ = ("worker_id", "address", "estimated_wait_ms", "adapter_resident")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    estimated_wait_ms: float
    adapter_resident: bool
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., estimated_wait_ms: _Optional[float] = ..., adapter_resident: _Optional[bool] = ...) -> None: ...

class ClusterViewRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerView(_message.Message):
    __slots__ = ("worker_id", "address", "queue", "running", "free_pages", "total_pages", "resident_adapters", "tokens_per_s", "placed_since_report", "report_age_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PLACED_SINCE_REPORT_FIELD_NUMBER: _ClassVar[int]
    REPORT_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    queue: int
    running: int
    free_pages: int
    total_pages: int
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    tokens_per_s: float
    placed_since_report: int
    report_age_ms: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., queue: _Optional[int] = ..., running: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., tokens_per_s: _Optional[float] = ..., placed_since_report: _Optional[int] = ..., report_age_ms: _Optional[float] = ...) -> None: ...

class ClusterViewResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerView]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerView, _Mapping]]] = ...) -> None: ...
