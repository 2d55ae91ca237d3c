"""What the SDK returns and takes: plain dataclasses, free of protobuf and grpc.

Example:
    >>> completion = client.generate("The capital of France is", max_tokens=8)
    >>> completion.text, completion.finish_reason, completion.usage.completion_tokens
    (' Paris.', 'stop', 3)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    """How to pick each next token. ``None`` everywhere means the server's default.

    These fields are the sampling keywords of both clients' ``generate``/``stream``/``chat``/
    ``chat_stream`` (:mod:`loramesh.sampling_keywords`), declared here only: a field added here
    is a keyword of each, sent as the ``SamplingParams`` field of its name
    (:func:`loramesh.convert.sampling_params`). A preset can be kept as one value and spread
    into calls.

    Example:
        >>> creative = Sampling(temperature=0.9, top_p=0.95, max_tokens=200)
        >>> client.generate("Once upon a time", **dataclasses.asdict(creative))
    """

    max_tokens: int | None = None
    """Most tokens to generate (server default 128)."""
    temperature: float | None = None
    """0 or None: greedy decoding."""
    top_k: int | None = None
    """Sample among the k most likely tokens; None or 0: off."""
    top_p: float | None = None
    """Nucleus sampling mass; None, 0 or 1: off."""
    repetition_penalty: float | None = None
    """Penalty on tokens already seen; None, 0 or 1: off."""
    seed: int | None = None
    """Seed of the sampler, for reproducible sampling: each token's random draw is keyed by the
    seed and the token's position, not by the batch it ran in, so a failover continues with the
    tokens the unbroken stream would have had."""
    stop: tuple[str, ...] | list[str] | None = None
    """Strings that end the generation when produced."""
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    """Token ids that end the generation when produced."""
    ignore_eos: bool | None = None
    """Keep generating past the model's end-of-sequence token, up to ``max_tokens``."""


@dataclass(frozen=True)
class Usage:
    """Token counts and timings of one generation (from the stream's last message). When a stream
    was continued on another gateway after its own died, the token counts are still the whole
    generation's; the timings and ``resumes`` are the continuing gateway's.

    Example:
        >>> usage = client.generate("Hi").usage
        >>> usage.completion_tokens / (usage.total_ms / 1000)  # tokens per second
    """

    prompt_tokens: int
    """Tokens of the prompt (after the chat template, for chat)."""
    completion_tokens: int
    """Tokens generated."""
    first_token_ms: float
    """Milliseconds from the gateway receiving the request to the first token."""
    total_ms: float
    """Milliseconds from the gateway receiving the request to the last token."""
    resumes: int
    """Times the gateway moved the generation to another worker mid-stream after a failure."""
    migrations: int = 0
    """Times the scheduler moved it to another worker to balance load (output is unchanged)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV a worker's prefix cache held (their prefill was skipped): only
    what this request may share, its tenant's or its ``cache_salt``'s."""


@dataclass(frozen=True)
class ServedVersion:
    """The adapter version that serves a generation, fixed when the gateway admitted it.

    Example:
        >>> completion = client.generate("Hi", adapter="support-bot")
        >>> completion.served_by.fingerprint
        'support-bot@3 sha256:9f2c41d07a5e'
    """

    adapter: str
    """The adapter as the caller names it: ``"name"`` (its own) or ``"owner/name"``."""
    version: int
    """The store's version of the name."""
    sha256: str
    """Checksum of the version's weights file, whole."""
    adapter_id: str
    """The store's id of this version."""
    fingerprint: str
    """``"<adapter>@<version> sha256:<first 12 hex>"`` (OpenAI's ``system_fingerprint``)."""

    @property
    def reference(self) -> str:
        """What to pass as ``adapter=`` to be served by this version again: ``"<adapter>@<version>"``."""
        return f"{self.adapter}@{self.version}"


@dataclass(frozen=True)
class TextDelta:
    """One message of a stream: the text generated since the previous one.

    Example:
        >>> for delta in client.stream("Tell me a joke"):
        ...     print(delta.text, end="", flush=True)
    """

    text: str
    """New text, always whole UTF-8 characters (may be empty while a character is incomplete)."""
    token_ids: tuple[int, ...]
    """The tokens this text came from."""
    finish_reason: str | None
    """On the last delta only: ``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"``."""
    usage: Usage | None
    """On the last delta only."""
    request_id: str
    """The gateway's id of this generation."""
    served_by: ServedVersion | None = None
    """On a stream's first delta: the adapter version serving it (None for the base model, and
    on later deltas)."""


@dataclass(frozen=True)
class Completion:
    """A whole generation: the stream's deltas joined.

    Example:
        >>> completion = client.generate("2 + 2 =", max_tokens=4)
        >>> completion.text, completion.finish_reason
        (' 4', 'stop')
    """

    text: str
    """The generated text (without the prompt)."""
    token_ids: tuple[int, ...]
    """The generated tokens."""
    finish_reason: str | None
    """``"stop"`` (EOS, a stop token or stop string), ``"length"`` (max_tokens or the context
    is full), ``"cancelled"`` or ``"error"``; None only if the stream ended without one."""
    usage: Usage | None
    """Token counts and timings; None only if the stream ended without them."""
    request_id: str
    """The gateway's id of this generation."""
    served_by: ServedVersion | None = None
    """The adapter version that served it; None for the base model."""


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter registered in the mesh.

    Example:
        >>> adapter = client.adapters.get("support-bot")
        >>> adapter.rank, adapter.public, adapter.target_modules
        (8, False, ('q_proj', 'v_proj'))
    """

    id: str
    """Stable id, assigned at registration."""
    name: str
    """Unique per owner."""
    owner: str
    """Tenant that uploaded it."""
    public: bool
    """Whether every tenant may use it (as ``"owner/name"``); otherwise only its owner."""
    base_model: str
    """Base model it was validated against."""
    rank: int
    """The config's ``r``."""
    max_rank: int
    """Largest rank over the config's ``rank_pattern``."""
    lora_alpha: float
    """The config's ``lora_alpha``."""
    use_rslora: bool
    """Whether the scale is ``alpha / sqrt(r)`` rather than ``alpha / r``."""
    target_modules: tuple[str, ...]
    """Projections it adapts (a subset of q/k/v/o/gate/up/down)."""
    dtype: str
    """``float16``, ``bfloat16`` or ``float32``."""
    size_bytes: int
    """Size of the weights file."""
    sha256: str
    """Checksum of the weights file."""
    version: int
    """1 for the first registration of the name, +1 for each new version published under it
    (and for each re-registration after a delete)."""
    created_unix_ms: int
    """Registration time, milliseconds since the Unix epoch."""
    config_json: str
    """``adapter_config.json`` as uploaded."""
    pinned: bool = False
    """Whether it is pinned: the mesh's caches never evict it (``client.adapters.pin``)."""


@dataclass(frozen=True)
class AdapterPage:
    """One page of the adapters a caller may use, from ``client.adapters.list_page``.

    Example:
        >>> page = client.adapters.list_page(page_size=50)
        >>> while page.next_page_token:
        ...     page = client.adapters.list_page(page_size=50, page_token=page.next_page_token)
    """

    adapters: tuple[Adapter, ...]
    """At most the page size, in registration order (a new version after every older adapter)."""
    next_page_token: str
    """Pass it back for the next page; "" on the last page."""
    total: int
    """Adapters on all the pages together, when this page was read."""


@dataclass(frozen=True)
class ImportedAdapter:
    """What importing an adapter from a URI did.

    Example:
        >>> imported = client.adapters.import_uri("hf://my-org/support-bot", "support-bot")
        >>> imported.changed, imported.adapter.version
        (True, 1)
    """

    adapter: Adapter
    """The adapter the name now serves."""
    changed: bool
    """False when the name already held this content: it was kept, same id and version."""


@dataclass(frozen=True)
class PublishedVersion:
    """What publishing an adapter directory under a name did (``client.adapters.publish``).

    Example:
        >>> published = client.adapters.publish("./checkpoint-120", "policy")
        >>> published.version, published.sha256[:12]
        (7, '9f2c41d07a5e')
        >>> client.generate("Hi", adapter=f"policy@{published.version}")
    """

    version: int
    """The version the name serves now."""
    id: str
    """That version's id."""
    sha256: str
    """Checksum of that version's weights file."""
    changed: bool
    """False when the name already served this content: it was kept, same version and id."""
    adapter: Adapter
    """All the store says of that version."""


@dataclass(frozen=True)
class Model:
    """Something a caller can generate with: the base model or an adapter it may use.

    Example:
        >>> [m.id for m in client.models()]
        ['', 'support-bot', 'bob/legal-qa']
    """

    id: str
    """What to pass as ``adapter=``: ``""`` for the base model, ``"name"`` for the caller's own
    adapters, ``"owner/name"`` for other tenants' public ones."""
    owner: str
    """Tenant owning the adapter; ``""`` for the base model."""
    base_model: str
    """The base model's name."""
    is_base: bool
    """True for the base model itself."""
    rank: int
    """The adapter's (largest) rank; 0 for the base model."""
    public: bool
    """Whether the adapter is visible to every tenant."""
