"""Greedy answers of the base model and of each demo adapter in transformers + peft, without a mesh:
the quick way to see whether a change to the data or the training still gives each adapter its
behaviour on questions it never saw."""

from __future__ import annotations

from pathlib import Path

import torch

from demo_adapters.training import BaseModel, prompt_ids


def greedy_answer(model: torch.nn.Module, base: BaseModel, question: str, max_tokens: int) -> str:
    """The reply ``model`` gives ``question`` (chat template applied), greedy, end of turn excluded."""
    ids = torch.tensor([prompt_ids(base.tokenizer, question)])
    eos = list(base.tokenizer.eos_token_ids)
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
        )
    return base.tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


def preview(
    base: BaseModel, adapters: dict[str, Path], questions: list[str], max_tokens: int
) -> dict[str, dict[str, str]]:
    """Question -> {"base" or adapter name -> greedy answer}."""
    from peft import PeftModel

    answers = {q: {"base": greedy_answer(base.model, base, q, max_tokens)} for q in questions}
    for name, directory in adapters.items():
        model = PeftModel.from_pretrained(base.model, str(directory)).eval()
        try:
            for question in questions:
                answers[question][name] = greedy_answer(model, base, question, max_tokens)
        finally:
            model.unload()
    return answers
