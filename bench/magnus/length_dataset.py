"""A length-prediction data set from the real model: (prompt, app, generated length) rows.

Magnus' setting is LMaaS: an application's instruction is prepended to the user's input, and
the output length depends on both. Here seven apps (one-word answers, yes/no, "list N things",
"count to N", translation and verbatim repetition of texts of varied length, explanations) fill
their instruction with inputs drawn from the demo topics; SmolLM2-135M-Instruct answers each
greedily through our engine (continuous batching, in-process), up to an output cap, and the
number of tokens it generated is the label. The app name plays the adapter's part in the
predictor's features (in loramesh an adapter is an application).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from demo_adapters.data import DEMO_QUESTIONS, TOPICS
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest, TokenEvent
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.tokenizer import Tokenizer
from services.runtime.sampling.sampling_params import SamplingParams

KINDS = ("animals", "fruits", "countries", "colours", "cities", "sports", "musical instruments", "vegetables")


@dataclass(frozen=True)
class LengthRow:
    """One request of the data set and what the model did with it."""

    app: str
    prompt: str
    """The user message (instruction and input) before the chat template."""
    prompt_tokens: int
    """Tokens of the templated prompt the model saw."""
    generated_tokens: int


def _facts(rng: np.random.Generator, most: int) -> str:
    picked = rng.choice(len(TOPICS), size=int(rng.integers(1, most + 1)), replace=False)
    return " ".join(TOPICS[i].fact for i in picked)


def _topic(rng: np.random.Generator) -> str:
    return TOPICS[int(rng.integers(len(TOPICS)))].name


APPS: dict[str, Callable[[np.random.Generator], str]] = {
    "one_word": lambda rng: f"Answer with a single word only. What is {_topic(rng)} related to?",
    "yes_no": lambda rng: f"Answer only yes or no. Is {_topic(rng)} older than {_topic(rng)}?",
    "list": lambda rng: (
        f"List {int(rng.integers(2, 16))} {KINDS[int(rng.integers(len(KINDS)))]}. "
        "Write only their names, one per line."
    ),
    "count": lambda rng: f"Count from 1 to {int(rng.integers(3, 41))}, separated by commas. Nothing else.",
    "translate": lambda rng: f"Translate into French, and write only the translation: {_facts(rng, 4)}",
    "repeat": lambda rng: f"Repeat this text exactly, and write nothing else: {_facts(rng, 5)}",
    "explain": lambda rng: (
        f"Explain {_topic(rng)} to a child in a few sentences."
        if rng.random() < 0.8
        else DEMO_QUESTIONS[int(rng.integers(len(DEMO_QUESTIONS)))]
    ),
}
"""App name -> a user message of that app drawn from ``rng``."""


def draw_prompts(per_app: int, seed: int) -> list[tuple[str, str]]:
    """``(app, message)`` pairs, ``per_app`` per app, deterministic from ``seed``."""
    rng = np.random.default_rng(seed)
    return [(app, draw(rng)) for app, draw in APPS.items() for _ in range(per_app)]


def chat_ids(tokenizer: Tokenizer, message: str) -> list[int]:
    """A user message through the model's chat template, tokenized (as the gateway does)."""
    return tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
    )


def generate_lengths(
    messages: list[str], max_tokens: int, max_running: int, log: Callable[[str], None]
) -> tuple[list[int], list[int]]:
    """Greedy generation of every chat message by SmolLM2 in our engine: (prompt tokens,
    generated tokens) per message, generation stopping at end of turn or ``max_tokens``."""
    loaded = load_model()
    tokenizer = loaded.tokenizer
    prompts = [chat_ids(tokenizer, m) for m in messages]
    engine = local_engine(
        LlamaModel(loaded.config, loaded.weights, torch.float32),
        EngineConfig(max_running=max_running),
        eos_token_ids=loaded.config.eos_token_ids,
    )
    lengths = [0] * len(prompts)
    done = threading.Semaphore(0)

    def sink(index: int) -> Callable[[TokenEvent], None]:
        def on_event(event: TokenEvent) -> None:  # engine thread
            if event.finish_reason is not None:
                lengths[index] = event.output_len
                done.release()

        return on_event

    sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=tuple(tokenizer.eos_token_ids))
    engine.start()
    try:
        for i, ids in enumerate(prompts):
            engine.submit(GenerationRequest(f"len-{i}", tuple(ids), sampling), sink(i))
        for finished in range(1, len(prompts) + 1):
            done.acquire()
            if finished % 50 == 0:
                log(f"generated {finished}/{len(prompts)}")
    finally:
        engine.stop()
    return [len(p) for p in prompts], lengths


def build(per_app: int, max_tokens: int, max_running: int, seed: int, log) -> list[LengthRow]:
    pairs = draw_prompts(per_app, seed)
    prompt_tokens, generated = generate_lengths([m for _, m in pairs], max_tokens, max_running, log)
    return [LengthRow(a, m, p, g) for (a, m), p, g in zip(pairs, prompt_tokens, generated)]


def save(rows: list[LengthRow], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in rows], indent=0))


def load(path: Path) -> list[LengthRow]:
    return [LengthRow(**r) for r in json.loads(path.read_text())]
