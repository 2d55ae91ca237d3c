"""LoRAX's (text-generation-inference's) request body, ``{"inputs", "parameters", "stream"}``,
parsed and checked here, before anything is placed, and mapped onto the core's sampling.

``parameters.adapter_id`` is a loramesh adapter (``name`` or ``owner/name``); absent, empty or
the base model's id: the base model. Sampling follows LoRAX: greedy unless ``do_sample`` is
true or a sampling parameter is given that changes the distribution (``temperature`` ≠ 1,
``top_k`` > 0, ``top_p`` < 1). ``max_new_tokens`` absent: the gateway's default
(``--default-max-tokens``), not the rest of the context as in LoRAX.

``frequency_penalty`` and ``presence_penalty`` are OpenAI's penalties, as in LoRAX; LoRAX's
``response_format`` (``{"type": "json_object", "schema": {...}}``; without a schema, any JSON
object) constrains the output as the OpenAI routes' does (:mod:`.response_format`).

Parameters loramesh cannot honour are refused naming the field (422, as LoRAX refuses what it
cannot validate); the ones that change nothing here are accepted: ``stream`` on ``/generate``
and ``/generate_stream`` (the route decides), ``details`` on either (honoured),
``adapter_source`` ``null``, ``best_of`` 1, ``watermark``/``decoder_input_details``/
``apply_chat_template`` false, and fields this version does not know.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mesh_api.v1 import types_pb2
from services.gateway.http.response_format import ResponseFormat
from services.runtime.sampling.request_validation import InvalidField, check_sampling

#: The names the shared checks use for the fields LoRAX spells otherwise.
_LORAX_NAMES = {"max_tokens": "max_new_tokens", "top_logprobs": "return_k_alternatives"}


class _Body(BaseModel):
    # Unknown fields are ignored, as LoRAX does.
    model_config = ConfigDict(extra="ignore")


class LoraxParameters(_Body):
    adapter_id: str | None = None
    adapter_source: str | None = None
    merged_adapters: Any = None
    api_token: str | None = None
    best_of: int | None = None
    do_sample: bool = False
    max_new_tokens: int | None = None
    ignore_eos_token: bool = False
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    return_full_text: bool | None = None
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    return_k_alternatives: int | None = None
    apply_chat_template: bool = False
    response_format: ResponseFormat | None = None

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        """``(field, set, why)`` for every parameter loramesh cannot honour."""
        return [
            ("adapter_source", self.adapter_source is not None, "adapters are loramesh's own, by name"),
            ("merged_adapters", self.merged_adapters is not None, "no adapter merging"),
            ("best_of", (self.best_of or 1) > 1, "one sequence per request"),
            ("typical_p", self.typical_p is not None, "use top_p or top_k"),
            ("watermark", self.watermark, "no watermarking"),
            ("decoder_input_details", self.decoder_input_details, "no prompt log-probabilities"),
            ("apply_chat_template", self.apply_chat_template, "send messages to /v1/chat/completions"),
        ]  # fmt: skip

    @property
    def samples(self) -> bool:
        """LoRAX's rule: sample when asked to, or when a parameter reshapes the distribution."""
        return (
            self.do_sample
            or (self.temperature is not None and self.temperature != 1.0)
            or (self.top_k or 0) > 0
            or (self.top_p is not None and self.top_p < 1.0)
        )

    def _values(self) -> dict[str, Any]:
        """The sampling fields as given, with LoRAX's defaults filled in."""
        return {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "presence_penalty": self.presence_penalty or 0.0,
            "stop_strings": [s for s in self.stop if s],
        }

    def check(self, max_tokens_limit: int) -> None:
        """Refuse what loramesh cannot do and what is out of range, naming the field as LoRAX
        spells it."""
        for field, is_set, why in self._unsupported():
            if is_set:
                raise InvalidField(field, f"{field} is not supported by loramesh ({why})")
        self.structured_output()  # a malformed response_format is refused here, like the rest
        if self.truncate is not None and self.truncate < 1:
            raise InvalidField("truncate", f"truncate must be at least 1, got {self.truncate}")
        if self.max_new_tokens is not None and self.max_new_tokens > max_tokens_limit:
            raise InvalidField(
                "max_new_tokens",
                f"max_new_tokens {self.max_new_tokens} is above the limit {max_tokens_limit}",
            )
        try:
            check_sampling(
                max_tokens=self.max_new_tokens,
                seed=self.seed,
                top_logprobs=self.return_k_alternatives,
                **self._values(),
            )
        except InvalidField as error:
            name = _LORAX_NAMES.get(error.field, error.field)
            raise InvalidField(name, error.message.replace(error.field, name, 1)) from None

    def sampling(self) -> types_pb2.SamplingParams:
        """The engine's sampling parameters (after :meth:`check`). Every token carries its
        log-probability (LoRAX's tokens always have one), with ``return_k_alternatives``
        alternatives."""
        values = self._values()
        if not self.samples:
            values.update(temperature=0.0, top_p=1.0, top_k=0)
        return types_pb2.SamplingParams(
            max_tokens=self.max_new_tokens or 0,  # 0: the gateway's default
            ignore_eos=self.ignore_eos_token,
            top_logprobs=self.return_k_alternatives or 0,
            seed=self.seed,  # protobuf leaves a field given None unset: no seed
            structured_output=self.structured_output(),  # None: free text
            **values,
        )

    def structured_output(self) -> types_pb2.StructuredOutput | None:
        """What ``response_format`` constrains the output to; None: free text."""
        return self.response_format.structured_output() if self.response_format else None


class LoraxGenerateBody(_Body):
    """``POST /generate``, ``/generate_stream`` and ``/`` (which reads ``stream``)."""

    inputs: str
    parameters: LoraxParameters = Field(default_factory=LoraxParameters)
    stream: bool = False

    def check(self, max_tokens_limit: int) -> None:
        if not self.inputs:
            raise InvalidField("inputs", "inputs cannot be empty")
        self.parameters.check(max_tokens_limit)

    def prompt(self, ids: list[int]) -> list[int]:
        """The prompt's token ids after ``truncate`` (which keeps the last ones, as LoRAX)."""
        truncate = self.parameters.truncate
        return ids[-truncate:] if truncate else ids

    def authorization(self, header: str) -> str:
        """The ``Authorization`` header, or else LoRAX's ``api_token`` as the API key."""
        token = self.parameters.api_token
        return header or (f"Bearer {token}" if token else "")
