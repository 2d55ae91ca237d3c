"""How a request wants its tokens picked: the engine's sampling parameters, as plain values.

Torch-free, so the gateway reads and checks them exactly as the worker does
(:mod:`services.runtime.sampling.sampling_proto` translates the wire message).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.runtime.sampling.request_validation import check_sampling

StructuredKind = Literal["json_schema", "json_object"]


@dataclass(frozen=True)
class StructuredOutput:
    """What a constrained generation must produce (OpenAI's ``response_format``); the grammar
    that enforces it is built from this by the worker."""

    kind: StructuredKind
    """``json_schema``: an instance of ``schema``; ``json_object``: any JSON object."""
    schema: str = ""
    """The JSON Schema as JSON text (``json_schema``); empty for ``json_object``."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token; the defaults are greedy decoding of up to 128 tokens."""

    max_tokens: int = 128
    """Tokens to generate at most (finish reason ``length``)."""
    temperature: float = 0.0
    """0 = greedy; otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability adds up to p (1 = off)."""
    repetition_penalty: float = 1.0
    """CTRL-style penalty on tokens already in the prompt or output (1 = off)."""
    seed: int | None = None
    """Makes sampling reproducible for this request."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra tokens that end generation (the model's EOS always does unless ``ignore_eos``)."""
    stop_strings: tuple[str, ...] = field(default_factory=tuple)
    """Generation ends when the output text contains one of these."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    top_logprobs: int | None = None
    """Set: report each token's log-probability and this many most likely alternatives."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output (not the prompt), in
    [-2, 2] (0 = off)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it is already in the output (not the
    prompt), in [-2, 2] (0 = off)."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one, after temperature
    (0 = off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, each bias in [-100, 100] added to that token's logit before
    anything else; a tuple so the params stay immutable and hashable."""
    structured_output: StructuredOutput | None = None
    """Set: the output is constrained to JSON; None: free text."""
    no_speculation: bool = False
    """True: the worker drafts nothing for it (speculative decoding off for this request)."""

    def validate(self) -> None:
        """Raise ``InvalidArgument`` naming the first field out of range."""
        check_sampling(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop_strings=self.stop_strings,
            top_logprobs=self.top_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_p=self.min_p,
            logit_bias=self.logit_bias,
            structured_output=self.structured_output,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes_output(self) -> bool:
        """A presence or frequency penalty is set (they read the output tokens' counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
