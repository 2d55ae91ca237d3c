from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SuggestCreditorsRequest(_message.Message):
    __slots__ = ("debtor_id", "blocks")
    DEBTOR_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    debtor_id: str
    blocks: int
    def __init__(self, debtor_id: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class CreditorCandidate(_message.Message):
    __slots__ = ("worker_id", "address", "lendable_blocks", "topology", "same_topology")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENDABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    SAME_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    lendable_blocks: int
    topology: str
    same_topology: bool
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., lendable_blocks: _Optional[int] = ..., topology: _Optional[str] = ..., same_topology: _Optional[bool] = ...) -> None: ...

class SuggestCreditorsResponse(_message.Message):
    __slots__ = ("candidates",)
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[CreditorCandidate]
    def __init__(self, candidates: _Optional[_Iterable[_Union[CreditorCandidate, _Mapping]]] = ...) -> None: ...

class ReportRefusalRequest(_message.Message):
    __slots__ = ("creditor_id", "debtor_id")
    CREDITOR_ID_FIELD_NUMBER: _ClassVar[int]
    DEBTOR_ID_FIELD_NUMBER: _ClassVar[int]
    creditor_id: str
    debtor_id: str
    def __init__(self, creditor_id: _Optional[str] = ..., debtor_id: _Optional[str] = ...) -> None: ...

class ReportRefusalResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LedgerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LedgerEntry(_message.Message):
    __slots__ = ("worker_id", "address", "topology", "free_blocks", "total_blocks", "lent_blocks", "lendable_blocks", "refused", "report_age_ms")
    class LentBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LENDABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REPORT_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    topology: str
    free_blocks: int
    total_blocks: int
    lent_blocks: _containers.ScalarMap[str, int]
    lendable_blocks: int
    refused: bool
    report_age_ms: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., topology: _Optional[str] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., lent_blocks: _Optional[_Mapping[str, int]] = ..., lendable_blocks: _Optional[int] = ..., refused: _Optional[bool] = ..., report_age_ms: _Optional[float] = ...) -> None: ...

class LedgerResponse(_message.Message):
    __slots__ = ("workers", "instance_id", "leader_id", "dgfm_swaps_total", "dgfm_blocks_moved_total", "leader_term")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    DGFM_SWAPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DGFM_BLOCKS_MOVED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LEADER_TERM_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[LedgerEntry]
    instance_id: str
    leader_id: str
    dgfm_swaps_total: int
    dgfm_blocks_moved_total: int
    leader_term: int
    def __init__(self, workers: _Optional[_Iterable[_Union[LedgerEntry, _Mapping]]] = ..., instance_id: _Optional[str] = ..., leader_id: _Optional[str] = ..., dgfm_swaps_total: _Optional[int] = ..., dgfm_blocks_moved_total: _Optional[int] = ..., leader_term: _Optional[int] = ...) -> None: ...

class PlanDefragmentationRequest(_message.Message):
    __slots__ = ("min_swap_blocks",)
    MIN_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    min_swap_blocks: int
    def __init__(self, min_swap_blocks: _Optional[int] = ...) -> None: ...

class BlockRecall(_message.Message):
    __slots__ = ("owner_id", "holder_id", "blocks")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    holder_id: str
    blocks: int
    def __init__(self, owner_id: _Optional[str] = ..., holder_id: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class CycleSwap(_message.Message):
    __slots__ = ("cycle", "blocks", "recalls")
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RECALLS_FIELD_NUMBER: _ClassVar[int]
    cycle: _containers.RepeatedScalarFieldContainer[str]
    blocks: int
    recalls: _containers.RepeatedCompositeFieldContainer[BlockRecall]
    def __init__(self, cycle: _Optional[_Iterable[str]] = ..., blocks: _Optional[int] = ..., recalls: _Optional[_Iterable[_Union[BlockRecall, _Mapping]]] = ...) -> None: ...

class PlanDefragmentationResponse(_message.Message):
    __slots__ = ("swaps", "frozen_workers", "blocks_moved", "remote_blocks_before", "remote_blocks_after")
    SWAPS_FIELD_NUMBER: _ClassVar[int]
    FROZEN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_MOVED_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_AFTER_FIELD_NUMBER: _ClassVar[int]
    swaps: _containers.RepeatedCompositeFieldContainer[CycleSwap]
    frozen_workers: _containers.RepeatedScalarFieldContainer[str]
    blocks_moved: int
    remote_blocks_before: int
    remote_blocks_after: int
    def __init__(self, swaps: _Optional[_Iterable[_Union[CycleSwap, _Mapping]]] = ..., frozen_workers: _Optional[_Iterable[str]] = ..., blocks_moved: _Optional[int] = ..., remote_blocks_before: _Optional[int] = ..., remote_blocks_after: _Optional[int] = ...) -> None: ...

class DefragmentRequest(_message.Message):
    __slots__ = ("min_swap_blocks",)
    MIN_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    min_swap_blocks: int
    def __init__(self, min_swap_blocks: _Optional[int] = ...) -> None: ...

class DefragmentResponse(_message.Message):
    __slots__ = ("plan", "swaps_done", "blocks_moved", "failed_worker", "error_code", "error")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SWAPS_DONE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_MOVED_FIELD_NUMBER: _ClassVar[int]
    FAILED_WORKER_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    plan: PlanDefragmentationResponse
    swaps_done: int
    blocks_moved: int
    failed_worker: str
    error_code: str
    error: str
    def __init__(self, plan: _Optional[_Union[PlanDefragmentationResponse, _Mapping]] = ..., swaps_done: _Optional[int] = ..., blocks_moved: _Optional[int] = ..., failed_worker: _Optional[str] = ..., error_code: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class AnnouncePrefixBlocksRequest(_message.Message):
    __slots__ = ("worker_id", "kv_identity", "replace", "added", "removed")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kv_identity: str
    replace: bool
    added: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[str] = ..., kv_identity: _Optional[str] = ..., replace: _Optional[bool] = ..., added: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AnnouncePrefixBlocksResponse(_message.Message):
    __slots__ = ("index_id", "held_blocks")
    INDEX_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    index_id: str
    held_blocks: int
    def __init__(self, index_id: _Optional[str] = ..., held_blocks: _Optional[int] = ...) -> None: ...

class LocatePrefixRequest(_message.Message):
    __slots__ = ("worker_id", "kv_identity", "keys")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kv_identity: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[str] = ..., kv_identity: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LocatePrefixResponse(_message.Message):
    __slots__ = ("holder_id", "address", "blocks", "index_id")
    HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INDEX_ID_FIELD_NUMBER: _ClassVar[int]
    holder_id: str
    address: str
    blocks: int
    index_id: str
    def __init__(self, holder_id: _Optional[str] = ..., address: _Optional[str] = ..., blocks: _Optional[int] = ..., index_id: _Optional[str] = ...) -> None: ...
