"""A submitted request checked and made the engine's, on the caller's thread: a bad request is
the caller's error (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED) before it reaches a queue."""

from __future__ import annotations

from collections.abc import Mapping

from services.gpu_worker.engine.request import EngineRequest, GenerationRequest
from services.gpu_worker.engine.structured_output import GrammarCompiler, GrammarKey, RequestGrammar
from services.gpu_worker.lora.activation import activation_start
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.memory.kv_cache import KvTable
from services.gpu_worker.memory.prefix_cache import PrefixCache
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.model_files.model_config import ModelConfig
from services.runtime.errors import InvalidArgument, NotFound, ResourceExhausted
from services.runtime.sampling.request_validation import check_request


class RequestIntake:
    """Checks requests against the model, the adapters loaded and the pool; compiles their
    grammars. ``borrowing``: the pool can overflow into other workers' (a prompt larger than the
    whole pool may still run)."""

    def __init__(
        self,
        model: ModelConfig,
        pool: UnifiedPool,
        prefix_cache: PrefixCache | None,
        grammars: GrammarCompiler | None,
        borrowing: bool,
    ):
        self.model = model
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.grammars = grammars
        self.borrowing = borrowing

    def take(self, request: GenerationRequest, host_adapters: Mapping[str, HostAdapter]) -> EngineRequest:
        """``request`` as the engine queues it (raises the caller's error when it cannot run)."""
        check_request(
            request.prompt_ids, request.sampling, self.model.vocab_size, self.model.max_position_embeddings
        )
        if request.adapter_id is not None and request.adapter_id not in host_adapters:
            raise NotFound(f"adapter {request.adapter_id!r} is not loaded on this worker")
        kv = KvTable(self.pool, self.prefix_cache)
        if not self.borrowing and kv.pages_needed(len(request.prompt_ids) + 1) > self.pool.layout.num_pages:
            raise ResourceExhausted(
                f"prompt of {len(request.prompt_ids)} tokens needs more KV pages than the whole pool has"
            )
        invocation = host_adapters[request.adapter_id].invocation_tokens if request.adapter_id else None
        adapter_from = activation_start(request.original_prompt_ids, invocation)
        return EngineRequest(spec=request, kv=kv, grammar=self._grammar(request), adapter_from=adapter_from)

    def _grammar(self, request: GenerationRequest) -> RequestGrammar | None:
        """The request's structured-output grammar, past what it generated before (a bad schema
        is the caller's INVALID_ARGUMENT)."""
        constraint = request.sampling.structured_output
        if constraint is None:
            return None
        if self.grammars is None:
            raise InvalidArgument("structured_output: this worker was started without grammar support")
        key = GrammarKey(constraint.kind, constraint.schema)
        return self.grammars.matcher(key, generated=request.resumed_ids)
