from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
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
VISIBILITY_UNSPECIFIED: Visibility
VISIBILITY_PRIVATE: Visibility
VISIBILITY_PUBLIC: Visibility
PET_TYPE_UNSPECIFIED: PetType
PET_TYPE_LORA: PetType

class AdapterInfo(_message.Message):
    __slots__ = ("id", "name", "owner", "visibility", "base_model", "pet_type", "rank", "max_rank", "lora_alpha", "use_rslora", "target_modules", "dtype", "size_bytes", "sha256", "version", "created_unix_ms", "config_json")
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
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., owner: _Optional[str] = ..., visibility: _Optional[_Union[Visibility, str]] = ..., base_model: _Optional[str] = ..., pet_type: _Optional[_Union[PetType, str]] = ..., rank: _Optional[int] = ..., max_rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., use_rslora: _Optional[bool] = ..., target_modules: _Optional[_Iterable[str]] = ..., dtype: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., version: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., config_json: _Optional[str] = ...) -> None: ...
