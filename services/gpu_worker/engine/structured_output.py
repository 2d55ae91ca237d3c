"""Structured outputs: each constrained request's grammar, and the token masks of a step.

A request may carry a JSON Schema (OpenAI's ``response_format: json_schema``, or a tool's
arguments) or ask for any JSON object. Its grammar allows, at each step, a set of next tokens; the
step masks every other token's logit to -inf before sampling, so whatever the sampler picks keeps
the output a prefix of a valid document, and once the document is complete only EOS is allowed.
One batch mixes requests for different adapters with different grammars and unconstrained ones:
masks are per row.

llguidance does the matching. Measured against xgrammar on SmolLM2's 49,152-token vocabulary, on
a 2-vCPU AMD EPYC (bench/HISTORY.md, "Structured outputs"): the same cost per mask (~70 µs
mean over a 43-token document), but a schema compiles in ~1 ms instead of ~170 ms, and it needs
neither triton nor transformers at run time.

The masks of a step are computed on a helper thread (llguidance drops the GIL) while the forward
pass runs: they depend only on the tokens accepted so far, which are known before the step.
They stay packed (``ceil(V / 32)`` int32 words a row, in a host buffer kept from step to step),
go to a device buffer also kept, and are unpacked on the logits' device (``grammar_bitmask``):
no vocabulary-wide mask is built on the host or copied.

JSON is generated compactly, with ``", "`` and ``": "`` as separators and no other whitespace: a
grammar that allows free whitespace lets a small model emit newlines until ``max_tokens``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import llguidance
import torch

from services.gpu_worker.engine.grammar_bitmask import mask_logits_
from services.gpu_worker.engine.side_threads import side_thread_pool
from services.runtime.errors import InvalidArgument

#: How JSON is written under a grammar (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: Any JSON object (OpenAI's ``response_format: json_object``).
ANY_OBJECT_SCHEMA = {"type": "object"}

FIELD = "structured_output"
"""The request field refusals name."""


@dataclass(frozen=True)
class GrammarKey:
    """What a grammar is compiled from: the cache key of :class:`GrammarCompiler`."""

    kind: str
    """``"json_schema"`` or ``"json_object"``."""
    schema: str = ""
    """The JSON Schema's text (``json_schema`` only)."""


class RequestGrammar:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False (the grammar is now in error) when it is not allowed."""
        return self.matcher.consume_token(token) and not self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GrammarCompiler:
    """Grammars for one model's tokenizer: compiled once per schema, a matcher per request."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256
    ):
        """``tokenizer_json``: the model's ``tokenizers`` JSON; ``vocab_size``: the logits' width
        (it may exceed the tokenizer's: padded rows are never allowed)."""
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[GrammarKey, str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # submissions validate on gRPC threads; the engine compiles too

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (~0.25 s): a worker that never sees a constrained request pays nothing."""
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._lltokenizer

    def grammar(self, key: GrammarKey) -> str:
        """The compiled grammar of ``key``; ``InvalidArgument`` naming the schema's problem."""
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        grammar = self._compile(key)
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > self._cache_size:
                self._grammars.popitem(last=False)
        return grammar

    def matcher(self, key: GrammarKey, generated: Sequence[int] = ()) -> RequestGrammar:
        """A request's grammar, advanced past the tokens it has ``generated`` already (a request
        resumed elsewhere, or handed over from another worker)."""
        request = RequestGrammar(llguidance.LLMatcher(self.lltokenizer, self.grammar(key)))
        for token in generated:
            if not request.accept(token):
                raise InvalidArgument(
                    f"{FIELD}: the tokens generated so far do not follow the schema ({request.error})"
                )
        return request

    def _compile(self, key: GrammarKey) -> str:
        if key.kind == "json_object":
            schema = ANY_OBJECT_SCHEMA
        elif key.kind == "json_schema":
            try:
                schema = json.loads(key.schema)
            except ValueError as error:
                raise InvalidArgument(f"{FIELD}.json_schema is not valid JSON: {error}") from None
            if not isinstance(schema, dict):
                raise InvalidArgument(
                    f"{FIELD}.json_schema must be a JSON object, not {type(schema).__name__}"
                )
        else:
            raise InvalidArgument(f"{FIELD}: unknown kind {key.kind!r} (json_schema or json_object)")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as error:
            raise InvalidArgument(f"{FIELD}.json_schema: {error}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if problem and not problem.startswith("WARNING"):
            raise InvalidArgument(f"{FIELD}.json_schema is not a schema loramesh can follow: {problem}")
        return grammar


class StepMasks:
    """The token masks of one step's constrained rows, being computed on a helper thread into
    the planner's bitmask buffer (valid until the planner's next :meth:`MaskPlanner.start`)."""

    def __init__(self, rows: list[int], planner: MaskPlanner, done: Future):
        self.rows = rows
        """Indices of the constrained rows in the step's batch."""
        self._planner = planner
        self._done = done

    def wait(self) -> None:
        """Until the masks are computed (or their computation failed: raised here)."""
        self._done.result()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[batch, vocab]`` with every token a constrained row may not take at -inf,
        as a new tensor (waits for the masks; unconstrained rows are returned as they were). The
        packed words go to the logits' device and are unpacked there: no vocabulary-sized mask
        is built on the host or copied."""
        self.wait()
        bitmask, rows = self._planner.on_device(self.rows, logits.shape[0], logits.device)
        masked = logits.clone()
        mask_logits_(masked, bitmask, rows)
        return masked


class MaskPlanner:
    """Starts each step's masks before its forward pass (one helper thread per engine).

    llguidance writes a step's packed bitmask (``ceil(V / 32)`` int32 words a row) into one
    host buffer kept from step to step (pinned where CUDA is, so its copy is asynchronous); the
    words are copied into a device buffer also kept from step to step, and applied there."""

    def __init__(self, vocab_size: int):
        self._vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._thread = side_thread_pool(1, "grammar-masks")
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._host = torch.empty(0, self._words, dtype=torch.int32)
        self._device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        """Per logits device other than the CPU: its bitmask and row index buffers."""
        self._copied: torch.cuda.Event | None = None
        """Recorded after the last copy out of the pinned host buffer, which the next step's
        masks must not overwrite before that copy has run."""

    def start(self, grammars: Sequence[RequestGrammar | None]) -> StepMasks | None:
        """Masks for the rows whose grammar is not None; None when the step has none."""
        rows = [i for i, grammar in enumerate(grammars) if grammar is not None]
        if not rows:
            return None
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self._host.shape[0] < len(rows):
            # Not llguidance.torch: importing it runs torch.compile, which imports triton, and
            # triton imported before TRITON_INTERPRET is set cannot interpret kernels (the CPU
            # tests' mode). Grown to a power of two, so a growing batch reallocates rarely.
            capacity = 1 << (len(rows) - 1).bit_length()
            self._host = torch.empty(
                capacity, self._words, dtype=torch.int32, pin_memory=torch.cuda.is_available()
            )
        bitmask = self._host[: len(rows)]
        bitmask.fill_(-1)
        matchers = [(grammars[row].matcher, k) for k, row in enumerate(rows)]
        one_mask_bytes = bitmask.shape[1] * bitmask.element_size()
        done = self._thread.submit(
            self._executor.unsafe_compute_mask_ptr, matchers, bitmask.data_ptr(), one_mask_bytes, len(rows)
        )
        return StepMasks(rows, self, done)

    def on_device(
        self, rows: list[int], batch: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The computed bitmask of ``rows`` on ``device`` and the rows' indices there (None:
        every row of the batch is constrained, in order)."""
        count = len(rows)
        every_row = count == batch
        host = self._host[:count]
        if device.type == "cpu":
            return host, None if every_row else torch.tensor(rows)
        buffers = self._device.get(device)
        if buffers is None or buffers[0].shape[0] < self._host.shape[0]:
            buffers = self._device[device] = (
                torch.empty(self._host.shape, dtype=torch.int32, device=device),
                torch.empty(self._host.shape[0], dtype=torch.int64, device=device),
            )
        bitmask, indices = buffers[0][:count], buffers[1][:count]
        bitmask.copy_(host, non_blocking=True)
        if device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        if every_row:
            return bitmask, None
        indices.copy_(torch.tensor(rows))
        return bitmask, indices

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, ceil(V/32)]`` int32 bitmask -> ``[rows, vocab_size]`` bool (bit ``j`` of word
    ``w`` is token ``32 w + j``; tokens past the bitmask are not allowed). The bit layout's
    reference, on the host: steps apply the words on the logits' device (``mask_logits_``)."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    padding = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool)
    return torch.cat([allowed, padding], dim=1)
