"""Settings of the gateway (flags ``--name``, env ``LORAMESH_NAME``): its own below, and the
chat templates' render budget, declared once in :class:`TemplateBudget`."""

from __future__ import annotations

from dataclasses import dataclass

from services.model_files.template_budget import TemplateBudget
from services.runtime.config import ServiceConfig, part_of, require_at_least, require_positive, settings_of


@dataclass
@settings_of(TemplateBudget)
class GatewayConfig(ServiceConfig):
    """loramesh gateway: the public API (auth, tenants, text in/out, streaming, resume)."""

    retain_freed_memory: bool = True
    """On here (off in the other services): every upload passes through megabyte-sized buffers."""
    api_keys: str = ""
    """Comma-separated ``key=tenant`` pairs (for a test mesh; prefer --api-keys-file)."""
    api_keys_file: str = ""
    """JSON object mapping API key -> tenant; a key may be given as its hash
    (``sha256:<salt>:<digest>``, what ``loramesh up`` writes), so the file holds no key."""
    model: str = ""
    """Base model whose tokenizer and chat template to use (default: SmolLM2-135M-Instruct)."""
    served_model_name: str = ""
    """The base model's name in the API (``/v1/models``, a request's ``model``, each response's),
    as vLLM's flag; empty: the model's own name (SmolLM2-135M-Instruct for the default model)."""
    max_model_len: int = 0
    """Tokens of one sequence at most, prompt and output together, as vLLM's flag: a request
    past it is refused, a generation stops at it; 0: the model's context length (longer than
    that is not served: the model's length stays in force)."""
    scheduler: str = ""
    """Scheduler address; empty: discovered in etcd."""
    adapter_store: str = ""
    """Adapter store address; empty: discovered in etcd."""
    max_prompt_tokens: int = 4096
    """Longest prompt accepted, in tokens."""
    prefix_block_tokens: int = 16
    """Tokens per block of the prompt's block hashes sent with each placement, for the
    scheduler's prefix-aware placement: the workers' ``--kv-block-tokens``; 0: none sent."""
    max_prompt_bytes: int = 2**20
    """Longest prompt accepted, in UTF-8 bytes, refused before any of it is tokenized: a
    prompt's text, or a chat's messages (contents and tool calls' arguments) together."""
    max_tokens_limit: int = 2048
    """Largest max_tokens a request may ask for."""
    default_max_tokens: int = 128
    """max_tokens when the request leaves it 0."""
    default_first_token_deadline_ms: float = 0.0
    """First-token SLO when the request gives none (0: no deadline)."""
    max_resumes: int = 3
    """How many times one stream may move to another worker after a failure."""
    adapter_cache_s: float = 2.0
    """How long an adapter lookup is reused before asking the store again."""
    adapter_access_cache: int = 4096
    """Adapter lookups (owner, name) cached at most (adapter_catalog.DEFAULT_MAX_ENTRIES); past it
    the least recently used tenth is dropped at once. At least 1."""
    openai_port: int = 0
    """Port of the OpenAI-compatible HTTP API (on ``--host``); 0 picks a free one."""
    adapter_load_dirs: str = ""
    """Comma-separated directories under which ``POST /v1/load_lora_adapter`` may read a
    ``lora_path`` on the gateway's machine (a relative ``lora_path`` is looked up under each, in
    order, never under the working directory); empty: loading by path is refused."""
    metric_adapter_labels: int = 50
    """Adapters named in each per-adapter series of ``/metrics`` (the top ones by requests); the
    rest are summed under ``adapter="other"`` (docs/metrics.md). At least 1."""
    chat_template_processes: int = 2
    """Processes that render chat templates, off the event loop; one tenant holds at most all
    but one of them at once (docs/security.md, "Chat templates")."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least(
            self,
            1,
            "max_prompt_bytes",
            "metric_adapter_labels",
            "chat_template_processes",
            "chat_template_max_operations",
            "chat_template_max_output_bytes",
            "chat_template_memory_mib",
        )
        require_positive(self, "chat_template_cpu_s")
        require_at_least(self, 0, "max_model_len", "prefix_block_tokens")

    def template_budget(self) -> TemplateBudget:
        """What one chat template render may spend."""
        return part_of(self, TemplateBudget)
