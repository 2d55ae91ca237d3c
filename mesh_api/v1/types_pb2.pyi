from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Visibility(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VISIBILITY_UNSPECIFIED: _ClassVar[Visibility]
    VISIBILITY_PRIVATE: _ClassVar[Visibility]
    VISIBILITY_PUBLIC: _ClassVar[Visibility]

class PetType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PET_TYPE_UNSPECIFIED: _ClassVar[PetType]
    PET_TYPE_LORA: _ClassVar[PetType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_MIGRATED: _ClassVar[FinishReason]
VISIBILITY_UNSPECIFIED: Visibility
VISIBILITY_PRIVATE: Visibility
VISIBILITY_PUBLIC: Visibility
PET_TYPE_UNSPECIFIED: PetType
PET_TYPE_LORA: PetType
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_MIGRATED: FinishReason

class AdapterInfo(_message.Message):
    __slots__ = ("id", "name", "owner", "visibility", "base_model", "pet_type", "rank", "max_rank", "lora_alpha", "use_rslora", "target_modules", "dtype", "size_bytes", "sha256", "version", "created_unix_ms", "config_json", "chat_template", "tool_use_chat_template", "pinned")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    VISIBILITY_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    PET_TYPE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    USE_RSLORA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    TOOL_USE_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    owner: str
    visibility: Visibility
    base_model: str
    pet_type: PetType
    rank: int
    max_rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    dtype: str
    size_bytes: int
    sha256: str
    version: int
    created_unix_ms: int
    config_json: str
    chat_template: str
    tool_use_chat_template: str
    pinned: bool
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., owner: _Optional[str] = ..., visibility: _Optional[_Union[Visibility, str]] = ..., base_model: _Optional[str] = ..., pet_type: _Optional[_Union[PetType, str]] = ..., rank: _Optional[int] = ..., max_rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., use_rslora: _Optional[bool] = ..., target_modules: _Optional[_Iterable[str]] = ..., dtype: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., version: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., config_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., tool_use_chat_template: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop_token_ids", "stop_strings", "ignore_eos", "top_logprobs", "presence_penalty", "frequency_penalty", "min_p", "logit_bias", "structured_output", "no_speculation")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    NO_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    structured_output: StructuredOutput
    no_speculation: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., no_speculation: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queued_ms", "first_token_ms", "total_ms", "prompt_tokens", "output_tokens", "preemptions")
    QUEUED_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    queued_ms: float
    first_token_ms: float
    total_ms: float
    prompt_tokens: int
    output_tokens: int
    preemptions: int
    def __init__(self, queued_ms: _Optional[float] = ..., first_token_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("queue", "running", "free_pages", "total_pages", "kv_pages", "adapter_pages", "resident_adapters", "tokens_per_s", "preemptions", "fragmentation", "ts", "free_blocks", "total_blocks", "lent_blocks", "borrowed_blocks", "lend_cap_blocks", "topology", "remote_attention_s", "remote_attention_calls", "remote_bytes_sent", "remote_bytes_received", "lent_attention_s", "decode_steps", "dgfm_recalls", "dgfm_blocks_recalled", "kv_manager_term", "kv_manager_leader", "leader_writes_accepted", "leader_writes_refused")
    class LentBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class BorrowedBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BORROWED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEND_CAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ATTENTION_S_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ATTENTION_CALLS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LENT_ATTENTION_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DGFM_RECALLS_FIELD_NUMBER: _ClassVar[int]
    DGFM_BLOCKS_RECALLED_FIELD_NUMBER: _ClassVar[int]
    KV_MANAGER_TERM_FIELD_NUMBER: _ClassVar[int]
    KV_MANAGER_LEADER_FIELD_NUMBER: _ClassVar[int]
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
    fragmentation: float
    ts: float
    free_blocks: int
    total_blocks: int
    lent_blocks: _containers.ScalarMap[str, int]
    borrowed_blocks: _containers.ScalarMap[str, int]
    lend_cap_blocks: int
    topology: str
    remote_attention_s: float
    remote_attention_calls: int
    remote_bytes_sent: int
    remote_bytes_received: int
    lent_attention_s: float
    decode_steps: int
    dgfm_recalls: int
    dgfm_blocks_recalled: int
    kv_manager_term: int
    kv_manager_leader: str
    leader_writes_accepted: int
    leader_writes_refused: int
    def __init__(self, queue: _Optional[int] = ..., running: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., kv_pages: _Optional[int] = ..., adapter_pages: _Optional[int] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., tokens_per_s: _Optional[float] = ..., preemptions: _Optional[int] = ..., fragmentation: _Optional[float] = ..., ts: _Optional[float] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., lent_blocks: _Optional[_Mapping[str, int]] = ..., borrowed_blocks: _Optional[_Mapping[str, int]] = ..., lend_cap_blocks: _Optional[int] = ..., topology: _Optional[str] = ..., remote_attention_s: _Optional[float] = ..., remote_attention_calls: _Optional[int] = ..., remote_bytes_sent: _Optional[int] = ..., remote_bytes_received: _Optional[int] = ..., lent_attention_s: _Optional[float] = ..., decode_steps: _Optional[int] = ..., dgfm_recalls: _Optional[int] = ..., dgfm_blocks_recalled: _Optional[int] = ..., kv_manager_term: _Optional[int] = ..., kv_manager_leader: _Optional[str] = ..., leader_writes_accepted: _Optional[int] = ..., leader_writes_refused: _Optional[int] = ...) -> None: ...

class LeaderTerm(_message.Message):
    __slots__ = ("term", "leader_id")
    TERM_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    term: int
    leader_id: str
    def __init__(self, term: _Optional[int] = ..., leader_id: _Optional[str] = ...) -> None: ...
