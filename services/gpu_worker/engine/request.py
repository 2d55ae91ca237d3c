"""One generation request as the engine tracks it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from services.gpu_worker.distkv import BlockTable
from services.gpu_worker.engine.sampling import SamplingParams, TokenLogprobs, draw_generator, request_seed
from services.gpu_worker.engine.speculation.request_drafter import RequestDrafter
from services.gpu_worker.engine.step_plan import AdapterSlot, PlannedRequest
from services.gpu_worker.engine.structured_output import RequestGrammar
from services.gpu_worker.memory.kv_cache import KvTable


class FinishReason(Enum):
    STOP = "stop"
    """EOS, a stop token or a stop string."""
    LENGTH = "length"
    """``max_tokens`` reached, or the model's context is full."""
    CANCELLED = "cancelled"
    ABORTED = "aborted"
    """The batch policy gave up on it (its first-token SLO was lost); the event says why."""
    ERROR = "error"
    MIGRATED = "migrated"
    """Handed off to another worker (the scheduler's migration); its gateway resumes it there."""
    NO_KV = "no_kv"
    """Only borrowed KV blocks could hold it and no worker lent them within ``loan_wait_s`` (and
    ``loan_wait_rounds``; the event says why): RESOURCE_EXHAUSTED to the caller."""


class RequestState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Timings:
    """Monotonic timestamps (seconds) of one request's life."""

    arrived: float = field(default_factory=time.monotonic)
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """What a caller submits."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter_id: str | None = None
    """Adapter to apply (must be registered with the engine), or None for the base model."""
    predicted_output_tokens: int | None = None
    """Tokens a length predictor expects it to generate (orders the queue under ``hrrn``);
    None: no prediction."""
    first_token_deadline_s: float | None = None
    """Seconds from its arrival on the engine to its first token, which the ``early_abort``
    policy holds it to (the caller's ``first_token_deadline_ms``, less what the gateway spent);
    None: the policy's own SLO (``EngineConfig.early_abort_slo_s``)."""
    resumed_output_tokens: int = 0
    """How many of the last prompt ids were generated before, by this request elsewhere (a
    gateway resuming it after a worker failure or a migration sends prompt + tokens so far):
    its grammar is advanced past them and its presence/frequency penalties count them."""
    prefix_cache_namespace: str = ""
    """Who it shares cached prompt KV with (``tenant:<id>`` or ``salt:<cache_salt>``, set by the
    gateway); "": every request that names none."""

    def __post_init__(self) -> None:
        deadline = self.first_token_deadline_s
        if deadline is not None and not (math.isfinite(deadline) and deadline > 0):
            raise ValueError(f"first_token_deadline_s must be > 0 (None: the default), got {deadline}")
        if not 0 <= self.resumed_output_tokens <= len(self.prompt_ids):
            raise ValueError(
                f"resumed_output_tokens must be in [0, {len(self.prompt_ids)}] (the prompt's length), "
                f"got {self.resumed_output_tokens}"
            )

    @property
    def original_prompt_ids(self) -> tuple[int, ...]:
        """The prompt as the client sent it, without the output of an earlier attempt."""
        return self.prompt_ids[: len(self.prompt_ids) - self.resumed_output_tokens]

    @property
    def resumed_ids(self) -> tuple[int, ...]:
        """The output of an earlier attempt (the end of ``prompt_ids``)."""
        return self.prompt_ids[len(self.prompt_ids) - self.resumed_output_tokens :]


@dataclass(frozen=True)
class RequestSummary:
    """A request queued or running on the engine, as migration decides on it."""

    request_id: str
    adapter_id: str | None
    context_tokens: int
    """Prompt plus the tokens generated so far: what a move recomputes at the target."""
    remaining_tokens: int
    """``max_tokens`` not generated yet."""
    running: bool
    waited_s: float
    """Since it arrived on this engine."""


@dataclass(frozen=True)
class TokenEvent:
    """One engine output: a new token, and/or the end of the request."""

    request_id: str
    token_id: int | None
    finish_reason: FinishReason | None
    timings: Timings
    output_len: int
    error: str = ""
    logprobs: TokenLogprobs | None = None
    """With ``token_id``, when the request's sampling params ask for log-probabilities."""
    cached_prompt_tokens: int = 0
    """:attr:`EngineRequest.cached_prompt_tokens` (known from its first token on)."""


@dataclass
class EngineRequest:
    """Engine-side state of a request: its tokens, its KV pages, its adapter reference."""

    spec: GenerationRequest
    kv: KvTable
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose KV is in the pool; reset to 0 by a preemption (recomputed later)."""
    state: RequestState = RequestState.WAITING
    holds_adapter: bool = False
    preemptions: int = 0
    timings: Timings = field(default_factory=Timings)
    seed: int | None = field(init=False, default=None)
    """What its draws are keyed by, with each token's position (:func:`request_seed`)."""
    text_tail: str = ""
    """End of the decoded output, long enough to find stop strings."""
    last_logprobs: TokenLogprobs | None = None
    """Log-probabilities of the token sampled last, until its event is sent."""
    table: BlockTable | None = None
    """Set once the request borrows KV blocks (``kv_overflow: borrow``): its blocks, local and
    remote, and ``kv`` is empty; None while all its KV is in ``kv`` (the fast path)."""
    prompt_block_keys: tuple[bytes, ...] = ()
    """Prefix-cache keys of its prompt's whole blocks, from its admission until its prefill is
    done and they are cached (``KvReservation.cache_prompt``); () otherwise."""
    grammar: RequestGrammar | None = None
    """Where its output stands in its structured-output grammar; None when unconstrained."""
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV the prefix cache held when it was first scheduled (the prefill it
    skipped); a restart after a preemption does not change it."""
    adapter_from: int | None = 0
    """First position its adapter applies to: 0 for a standard LoRA (all), the start of an
    activated LoRA's invocation in its prompt, None when its prompt lacks the invocation (the
    base model throughout, as PEFT runs it): ``lora/activation.py``."""
    loan_waits: int = 0
    """Admission rounds in which only borrowed KV blocks could start it (nothing ran nor was lent
    out on its worker) and none were lent; a preemption does not reset it: its whole wait is
    bounded."""
    loan_wait_since: float | None = None
    """When the first of those rounds came, by the engine's clock (None: none has)."""
    drafts: tuple[int, ...] = ()
    """Drafted tokens its next step verifies after its last token (speculative decoding), their
    KV positions reserved; () when it drafts none."""
    drafter: RequestDrafter | None = field(default=None, repr=False)
    """Its drafting state, from its first drafted step on (None: it has not drafted)."""
    request_id: str = field(init=False)
    """``spec.request_id`` (read many times a step: an attribute, not a property)."""
    total_len: int = field(init=False)
    """Prompt + output tokens so far; kept by :meth:`append_output` (read several times a step
    for every running request: an attribute, not a property)."""

    def __post_init__(self) -> None:
        self.seed = request_seed(self.spec.sampling)
        self.request_id = self.spec.request_id
        self.total_len = len(self.spec.prompt_ids) + len(self.output_ids)

    def append_output(self, token: int) -> None:
        """Its next output token (the only way ``output_ids`` grows)."""
        self.output_ids.append(token)
        self.total_len += 1

    def next_draw_generator(self) -> torch.Generator | None:
        """The random stream of its next token's draw (None when greedy), keyed by its seed and
        that token's position: recomputed after a preemption, or continued on another worker as
        prompt + tokens so far, it draws what it would have drawn."""
        return None if self.seed is None else draw_generator(self.seed, self.total_len)

    @property
    def all_ids(self) -> list[int]:
        return [*self.spec.prompt_ids, *self.output_ids]

    @property
    def new_tokens(self) -> int:
        """Tokens to feed this step: the whole prompt (prefill) or the last output (decode)."""
        return self.total_len - self.num_computed

    def planned(self, adapter: AdapterSlot | None) -> PlannedRequest:
        """Its share of the next step: its new tokens (and drafts), its local pages, ``adapter``."""
        start, end = self.num_computed, self.total_len
        if end - start == 1:  # decode: the one new token is the last of prompt + output
            tokens = (self.output_ids[-1] if self.output_ids else self.spec.prompt_ids[-1], *self.drafts)
        else:
            tokens = tuple(self.all_ids[start:end])
        borrowed = self.table is not None
        return PlannedRequest(
            request_id=self.request_id,
            token_ids=tokens,
            start_position=start,
            kv_blocks=() if borrowed else self.kv.frozen_blocks(),
            adapter=adapter,
            sampling=self.spec.sampling,
            borrowed=borrowed,
            adapter_from=self.adapter_from or 0,
            draft_tokens=len(self.drafts),
        )
