"""Training a demo adapter: the shared-prefix loss equals transformers' own, what is saved is a
PEFT folder the adapter store accepts, and the demo's training stays within its budget."""

from __future__ import annotations

import pytest
import torch

from demo_adapters.data import BEHAVIOURS, examples
from demo_adapters.training import (
    DEMO_CONFIGS,
    TOKEN_BUDGET,
    TrainingConfig,
    _reply_loss,
    load_base_model,
    train_adapter,
    trained_tokens,
)
from services.adapter_store.validation import ValidationLimits, validate_adapter
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS
from services.model_files.tokenizer_loading import load_tokenizer


def _tiny_lora_llama():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
    model = get_peft_model(LlamaForCausalLM(config), lora)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; make the LoRA matter
            torch.nn.init.normal_(parameter, std=0.1)
    return model


def test_the_shared_prefix_loss_and_gradients_equal_transformers_own():
    model = _tiny_lora_llama()
    prefix = [5, 6, 7, 8, 9]
    batch = [(prefix + [10, 11, 12, 13], 7), (prefix + [20, 21], 6), (prefix + [30, 31, 32, 33, 34, 35], 8)]
    trainable = [p for p in model.parameters() if p.requires_grad]

    ours = _reply_loss(model.base_model.model.model, model.base_model.model.lm_head, batch)
    our_grads = torch.autograd.grad(ours, trainable)

    length = max(len(ids) for ids, _ in batch)
    input_ids = torch.zeros((len(batch), length), dtype=torch.long)
    labels = torch.full((len(batch), length), -100)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, (ids, reply_start) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
        labels[row, reply_start : len(ids)] = torch.tensor(ids[reply_start:])
    theirs = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
    their_grads = torch.autograd.grad(theirs, trainable)

    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for a, b in zip(our_grads, their_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.model
def test_a_few_steps_give_a_peft_folder_the_store_accepts(tmp_path):
    base = load_base_model()
    config = TrainingConfig(steps=2, batch_size=2)
    losses = []
    directory = train_adapter(base, examples("pirate")[:4], config, tmp_path / "pirate",
                              on_step=lambda step, loss: losses.append(loss))  # fmt: skip
    assert len(losses) == 2
    assert not any("lora" in name for name, _ in base.model.named_parameters())  # LoRA removed again

    spec = load_base_model_spec()
    validated = validate_adapter((directory / "adapter_config.json").read_bytes(),
                                 (directory / "adapter_model.safetensors").read_bytes(),
                                 spec, ValidationLimits())  # fmt: skip
    assert validated.config.rank == 8 and validated.config.alpha == 16.0
    assert validated.target_modules == tuple(sorted(LORA_TARGETS))
    assert validated.layers == tuple(range(spec.num_layers))
    assert validated.dtype == "float32"
    assert validated.config.base_model_name_or_path == spec.name

    from safetensors.torch import load_file

    weights = load_file(directory / "adapter_model.safetensors")
    assert any(w.abs().max() > 0 for name, w in weights.items() if "lora_B" in name)  # it trained


def test_the_demo_training_stays_within_its_token_budget():
    """The work, not the time: tokens through the model bound the CPU-seconds on any machine.
    The adapters train in parallel, so the longest one must fit the budget's share of a core."""
    assert set(DEMO_CONFIGS) == set(BEHAVIOURS)
    tokenizer = load_tokenizer().tokenizer
    tokens = {
        name: trained_tokens(tokenizer, examples(name), config) for name, config in DEMO_CONFIGS.items()
    }
    assert sum(tokens.values()) <= TOKEN_BUDGET, tokens
    assert max(tokens.values()) <= TOKEN_BUDGET / 2, tokens


def test_trained_tokens_counts_every_drawn_example_in_full():
    tokenizer = load_tokenizer().tokenizer
    pirate = examples("pirate")[:3]
    lengths = [len(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": e.question}], add_generation_prompt=True))) + len(tokenizer.encode(e.answer)) + 1
        for e in pirate]  # fmt: skip
    # 2 steps of 2 draw 4 examples: all 3 once, then the first of a second shuffle.
    config = TrainingConfig(steps=2, batch_size=2)
    assert sum(lengths) < trained_tokens(tokenizer, pirate, config) <= sum(lengths) + max(lengths)
