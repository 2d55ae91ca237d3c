"""The streaming completion APIs the HTTP replay speaks: llama-server's ``/completion`` and
OpenAI's ``/v1/completions`` (loramesh's gateway).

Both are asked the same thing: the prompt as token ids (no tokenizer round trip, so both see the
same tokens), exactly the trace's output length with end of sequence ignored, greedy decoding
(temperature 0: the cheapest sampler on both, so sampling settings do not weigh on the
comparison), streamed.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.systems.http_replay import ChunkProgress
from bench.workload import TraceRequest

LORA_SCALE = 1.0


@dataclass(frozen=True)
class LlamaServerCompletion:
    """llama-server's native ``POST /completion``."""

    adapter_ids: bool = True
    """Name the request's adapter as ``"lora": [{"id": <adapter index>, "scale": 1}]`` (the
    server was started with the adapters as ``--lora`` in index order); False: no adapter (a
    server without any ``--lora``)."""
    path: str = "/completion"

    def body(self, request: TraceRequest, prompt: tuple[int, ...]) -> dict:
        body = {
            "prompt": list(prompt),
            "n_predict": request.output_len,
            "ignore_eos": True,
            # Every system computes every prompt: no reuse of a previous request's KV cache.
            "cache_prompt": False,
            "temperature": 0.0,
            "stream": True,
        }
        if self.adapter_ids:
            body["lora"] = [{"id": request.adapter, "scale": LORA_SCALE}]
        return body

    def progress(self, chunk: dict, output_tokens: int) -> ChunkProgress:
        # tokens_predicted is the slot's count so far: it also covers tokens whose text was held
        # back (an incomplete UTF-8 sequence), which send no chunk of their own.
        return ChunkProgress(
            output_tokens=max(output_tokens, int(chunk.get("tokens_predicted", 0))),
            finished=bool(chunk.get("stop")),
        )


@dataclass(frozen=True)
class OpenAICompletion:
    """OpenAI's ``POST /v1/completions`` as loramesh's gateway serves it, with vLLM's
    ``ignore_eos`` and ``return_token_ids`` extensions (each chunk carries its token ids, so
    tokens are counted, not text)."""

    model_names: tuple[str, ...]
    """``model`` of a request for adapter ``i``: ``model_names[i]`` (the adapter's name)."""
    path: str = "/v1/completions"

    def body(self, request: TraceRequest, prompt: tuple[int, ...]) -> dict:
        return {
            "model": self.model_names[request.adapter],
            "prompt": list(prompt),
            "max_tokens": request.output_len,
            "ignore_eos": True,
            "return_token_ids": True,
            "temperature": 0.0,
            "stream": True,
        }

    def progress(self, chunk: dict, output_tokens: int) -> ChunkProgress:
        choices = chunk.get("choices") or [{}]
        choice = choices[0]
        return ChunkProgress(
            output_tokens=output_tokens + len(choice.get("token_ids") or ()),
            finished=choice.get("finish_reason") is not None,
        )
