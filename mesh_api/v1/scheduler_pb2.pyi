from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlaceRequest(_message.Message):
    __slots__ = ("request_id", "adapter_id", "prompt_tokens", "max_tokens", "first_token_deadline_ms", "exclude_workers", "prompt_text", "prefer_worker", "prefix_blocks", "prefix_block_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PREFER_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter_id: str
    prompt_tokens: int
    max_tokens: int
    first_token_deadline_ms: float
    exclude_workers: _containers.RepeatedScalarFieldContainer[str]
    prompt_text: str
    prefer_worker: str
    prefix_blocks: _containers.RepeatedScalarFieldContainer[bytes]
    prefix_block_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., adapter_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., first_token_deadline_ms: _Optional[float] = ..., exclude_workers: _Optional[_Iterable[str]] = ..., prompt_text: _Optional[str] = ..., prefer_worker: _Optional[str] = ..., prefix_blocks: _Optional[_Iterable[bytes]] = ..., prefix_block_tokens: _Optional[int] = ...) -> None: ...

class PlaceResponse(_message.Message):
    __slots__ = ("worker_id", "address", "estimated_wait_ms", "adapter_resident", "predicted_output_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    estimated_wait_ms: float
    adapter_resident: bool
    predicted_output_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., estimated_wait_ms: _Optional[float] = ..., adapter_resident: _Optional[bool] = ..., predicted_output_tokens: _Optional[int] = ...) -> None: ...

class ReportCompletionRequest(_message.Message):
    __slots__ = ("request_id", "generated_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generated_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class ReportCompletionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("request_id", "target_worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target_worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., target_worker_id: _Optional[str] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("source_worker_id", "target_worker_id", "worker_request_id")
    SOURCE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    source_worker_id: str
    target_worker_id: str
    worker_request_id: str
    def __init__(self, source_worker_id: _Optional[str] = ..., target_worker_id: _Optional[str] = ..., worker_request_id: _Optional[str] = ...) -> None: ...

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

class SchedulerActivity(_message.Message):
    __slots__ = ("migration_policy", "prefetch_policy", "migrations", "migration_failures", "prefetches", "prefetch_failures", "rebalance_rounds", "length_predictor", "predictions", "completions_observed", "predictor_mae_tokens", "predictor_refits")
    MIGRATION_POLICY_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_POLICY_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REBALANCE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PREDICTOR_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_MAE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_REFITS_FIELD_NUMBER: _ClassVar[int]
    migration_policy: str
    prefetch_policy: str
    migrations: int
    migration_failures: int
    prefetches: int
    prefetch_failures: int
    rebalance_rounds: int
    length_predictor: str
    predictions: int
    completions_observed: int
    predictor_mae_tokens: float
    predictor_refits: int
    def __init__(self, migration_policy: _Optional[str] = ..., prefetch_policy: _Optional[str] = ..., migrations: _Optional[int] = ..., migration_failures: _Optional[int] = ..., prefetches: _Optional[int] = ..., prefetch_failures: _Optional[int] = ..., rebalance_rounds: _Optional[int] = ..., length_predictor: _Optional[str] = ..., predictions: _Optional[int] = ..., completions_observed: _Optional[int] = ..., predictor_mae_tokens: _Optional[float] = ..., predictor_refits: _Optional[int] = ...) -> None: ...

class ClusterViewResponse(_message.Message):
    __slots__ = ("workers", "activity")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerView]
    activity: SchedulerActivity
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerView, _Mapping]]] = ..., activity: _Optional[_Union[SchedulerActivity, _Mapping]] = ...) -> None: ...
