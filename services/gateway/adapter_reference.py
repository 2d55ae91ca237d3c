"""How a tenant names an adapter (``name``, ``owner/name``) and what a request holds once the
name is resolved: a :class:`ResolvedAdapter`, looked up once and handed down the request path
(chat template, placement, relay), so no later step asks the catalog again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from mesh_api.v1 import types_pb2
from services.model_files.peft_format import PeftConfig
from services.runtime.errors import InvalidArgument, NotFound
from services.runtime.prefix_keys import AdapterIdentity, content_sha256


@dataclass(frozen=True, slots=True)
class ResolvedAdapter:
    """One adapter a tenant may use, as a request resolved it (SGLang's ``LoRARef``)."""

    id: str
    """The store's id: what the scheduler places and the workers fetch."""
    owner: str
    """The tenant that owns it."""
    name: str
    """Unique per owner."""
    public: bool
    """Usable by every tenant; else by its owner only."""
    sha256: str
    """Of its weights, as the store registered them."""
    version: int
    """The store's version of the name: a new upload of the name is a new version (and id)."""
    created_s: int
    """Registration time, seconds since the epoch."""
    chat_template: str
    """Its own chat template, uploaded with it; "": the base model's applies."""
    tool_use_chat_template: str
    """Its template for requests that offer tools; "": ``chat_template``."""
    invocation_tokens: tuple[int, ...] | None = None
    """An activated LoRA's invocation sequence (None: a standard LoRA): the prompt before it is
    the base model's, so its cached blocks are named in the base model's key space."""
    content_sha256: str = ""
    """Of its config and weights, as a worker that holds it computes it
    (:func:`services.runtime.prefix_keys.content_sha256`): names its prefix blocks exactly as the
    workers key them; "": unknown (the info carried no config), its blocks are not named."""

    @property
    def identity(self) -> AdapterIdentity:
        """What names its prefix blocks (:func:`services.runtime.prefix_keys.request_block_keys`)."""
        return AdapterIdentity(self.id, self.content_sha256, self.invocation_tokens)

    @classmethod
    def of(cls, info: types_pb2.AdapterInfo) -> ResolvedAdapter:
        return cls(
            id=info.id,
            owner=info.owner,
            name=info.name,
            public=info.visibility == types_pb2.VISIBILITY_PUBLIC,
            sha256=info.sha256,
            version=info.version,
            created_s=info.created_unix_ms // 1000,
            chat_template=info.chat_template,
            tool_use_chat_template=info.tool_use_chat_template,
            invocation_tokens=_invocation_tokens(info.config_json),
            content_sha256=content_sha256(info.config_json, info.sha256) if info.config_json else "",
        )


class Named(Protocol):
    """An adapter as any listing or lookup shows it."""

    @property
    def owner(self) -> str: ...

    @property
    def name(self) -> str: ...


def split_reference(tenant: str, reference: str) -> tuple[str, str]:
    """``(owner, name)`` of ``reference`` as ``tenant`` wrote it: ``name`` is its own."""
    owner, sep, name = reference.partition("/")
    if not sep:
        return tenant, reference
    if not owner or not name or "/" in name:
        raise InvalidArgument(f"adapter {reference!r} must be 'name' or 'owner/name'")
    return owner, name


def model_id(tenant: str, adapter: Named) -> str:
    """What ``tenant`` passes to name ``adapter``: ``name`` if it is its own, else ``owner/name``."""
    return adapter.name if adapter.owner == tenant else f"{adapter.owner}/{adapter.name}"


def missing_adapter(owner: str, name: str) -> NotFound:
    """What the adapter store answers for a name it does not have
    (services/adapter_store/repository.py), word for word."""
    return NotFound(f"adapter {name!r} of owner {owner!r} not found")


def chat_template(adapter: ResolvedAdapter | None, with_tools: bool = False) -> str | None:
    """The template a chat with ``adapter`` is prompted with: its own (its ``tool_use`` one
    ``with_tools``, when it has one); None: the base model's (no adapter, or none of its own)."""
    if adapter is None:
        return None
    return (with_tools and adapter.tool_use_chat_template) or adapter.chat_template or None


def _invocation_tokens(config_json: str) -> tuple[int, ...] | None:
    """The aLoRA invocation of a registered adapter's config; None for a standard LoRA, or when
    the info carries no config (a listing page's): its prefix is then named as a standard
    LoRA's, which only misses base-model blocks it could have shared (never a wrong hit)."""
    if not config_json:
        return None
    try:
        return PeftConfig.from_json(config_json).invocation_tokens
    except InvalidArgument:  # validated at registration: only a store of another version disagrees
        return None
