from mesh_api.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterRef(_message.Message):
    __slots__ = ("id", "owned_name")
    ID_FIELD_NUMBER: _ClassVar[int]
    OWNED_NAME_FIELD_NUMBER: _ClassVar[int]
    id: str
    owned_name: OwnedName
    def __init__(self, id: _Optional[str] = ..., owned_name: _Optional[_Union[OwnedName, _Mapping]] = ...) -> None: ...

class OwnedName(_message.Message):
    __slots__ = ("owner", "name")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    owner: str
    name: str
    def __init__(self, owner: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class RegisterAdapterRequest(_message.Message):
    __slots__ = ("header", "chunk")
    class Header(_message.Message):
        __slots__ = ("name", "owner", "visibility", "total_bytes", "new_version")
        NAME_FIELD_NUMBER: _ClassVar[int]
        OWNER_FIELD_NUMBER: _ClassVar[int]
        VISIBILITY_FIELD_NUMBER: _ClassVar[int]
        TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
        NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
        name: str
        owner: str
        visibility: _types_pb2.Visibility
        total_bytes: int
        new_version: bool
        def __init__(self, name: _Optional[str] = ..., owner: _Optional[str] = ..., visibility: _Optional[_Union[_types_pb2.Visibility, str]] = ..., total_bytes: _Optional[int] = ..., new_version: _Optional[bool] = ...) -> None: ...
    class FileChunk(_message.Message):
        __slots__ = ("filename", "data")
        FILENAME_FIELD_NUMBER: _ClassVar[int]
        DATA_FIELD_NUMBER: _ClassVar[int]
        filename: str
        data: bytes
        def __init__(self, filename: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: RegisterAdapterRequest.Header
    chunk: RegisterAdapterRequest.FileChunk
    def __init__(self, header: _Optional[_Union[RegisterAdapterRequest.Header, _Mapping]] = ..., chunk: _Optional[_Union[RegisterAdapterRequest.FileChunk, _Mapping]] = ...) -> None: ...

class RegisterAdapterResponse(_message.Message):
    __slots__ = ("adapter", "changed")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    adapter: _types_pb2.AdapterInfo
    changed: bool
    def __init__(self, adapter: _Optional[_Union[_types_pb2.AdapterInfo, _Mapping]] = ..., changed: _Optional[bool] = ...) -> None: ...

class ImportAdapterRequest(_message.Message):
    __slots__ = ("uri", "name", "owner", "visibility")
    URI_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    VISIBILITY_FIELD_NUMBER: _ClassVar[int]
    uri: str
    name: str
    owner: str
    visibility: _types_pb2.Visibility
    def __init__(self, uri: _Optional[str] = ..., name: _Optional[str] = ..., owner: _Optional[str] = ..., visibility: _Optional[_Union[_types_pb2.Visibility, str]] = ...) -> None: ...

class ImportAdapterResponse(_message.Message):
    __slots__ = ("adapter", "changed")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    adapter: _types_pb2.AdapterInfo
    changed: bool
    def __init__(self, adapter: _Optional[_Union[_types_pb2.AdapterInfo, _Mapping]] = ..., changed: _Optional[bool] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: AdapterRef
    def __init__(self, ref: _Optional[_Union[AdapterRef, _Mapping]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("owner", "include_public", "page_size", "page_token")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    owner: str
    include_public: bool
    page_size: int
    page_token: str
    def __init__(self, owner: _Optional[str] = ..., include_public: _Optional[bool] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "next_page_token", "total")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[_types_pb2.AdapterInfo]
    next_page_token: str
    total: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[_types_pb2.AdapterInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class WatchAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchAdaptersResponse(_message.Message):
    __slots__ = ("upserted", "deleted_ids", "synced")
    UPSERTED_FIELD_NUMBER: _ClassVar[int]
    DELETED_IDS_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    upserted: _containers.RepeatedCompositeFieldContainer[_types_pb2.AdapterInfo]
    deleted_ids: _containers.RepeatedScalarFieldContainer[str]
    synced: bool
    def __init__(self, upserted: _Optional[_Iterable[_Union[_types_pb2.AdapterInfo, _Mapping]]] = ..., deleted_ids: _Optional[_Iterable[str]] = ..., synced: _Optional[bool] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: AdapterRef
    def __init__(self, ref: _Optional[_Union[AdapterRef, _Mapping]] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: _types_pb2.AdapterInfo
    def __init__(self, adapter: _Optional[_Union[_types_pb2.AdapterInfo, _Mapping]] = ...) -> None: ...

class FetchAdapterRequest(_message.Message):
    __slots__ = ("ref", "file_system")
    REF_FIELD_NUMBER: _ClassVar[int]
    FILE_SYSTEM_FIELD_NUMBER: _ClassVar[int]
    ref: AdapterRef
    file_system: str
    def __init__(self, ref: _Optional[_Union[AdapterRef, _Mapping]] = ..., file_system: _Optional[str] = ...) -> None: ...

class FetchAdapterResponse(_message.Message):
    __slots__ = ("header", "chunk")
    class Header(_message.Message):
        __slots__ = ("adapter", "total_bytes", "sha256", "blob_path")
        ADAPTER_FIELD_NUMBER: _ClassVar[int]
        TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
        SHA256_FIELD_NUMBER: _ClassVar[int]
        BLOB_PATH_FIELD_NUMBER: _ClassVar[int]
        adapter: _types_pb2.AdapterInfo
        total_bytes: int
        sha256: str
        blob_path: str
        def __init__(self, adapter: _Optional[_Union[_types_pb2.AdapterInfo, _Mapping]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., blob_path: _Optional[str] = ...) -> None: ...
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: FetchAdapterResponse.Header
    chunk: bytes
    def __init__(self, header: _Optional[_Union[FetchAdapterResponse.Header, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class SetAdapterPinnedRequest(_message.Message):
    __slots__ = ("ref", "pinned")
    REF_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    ref: AdapterRef
    pinned: bool
    def __init__(self, ref: _Optional[_Union[AdapterRef, _Mapping]] = ..., pinned: _Optional[bool] = ...) -> None: ...

class SetAdapterPinnedResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: _types_pb2.AdapterInfo
    def __init__(self, adapter: _Optional[_Union[_types_pb2.AdapterInfo, _Mapping]] = ...) -> None: ...

class ListPinnedAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPinnedAdaptersResponse(_message.Message):
    __slots__ = ("adapter_ids",)
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    adapter_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("adapters", "disk_bytes", "ram_bytes", "ram_budget_bytes", "ram_adapters", "ram_hits", "ram_misses", "uploads_in_flight")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RAM_HITS_FIELD_NUMBER: _ClassVar[int]
    RAM_MISSES_FIELD_NUMBER: _ClassVar[int]
    UPLOADS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    adapters: int
    disk_bytes: int
    ram_bytes: int
    ram_budget_bytes: int
    ram_adapters: int
    ram_hits: int
    ram_misses: int
    uploads_in_flight: int
    def __init__(self, adapters: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., ram_bytes: _Optional[int] = ..., ram_budget_bytes: _Optional[int] = ..., ram_adapters: _Optional[int] = ..., ram_hits: _Optional[int] = ..., ram_misses: _Optional[int] = ..., uploads_in_flight: _Optional[int] = ...) -> None: ...
