"""A mesh's greedy completion against transformers + peft on the same weights (teacher-forced)."""

from __future__ import annotations

from pathlib import Path

import torch

NEAR_TIE = 1e-4
"""A step whose HF top-2 logits are closer than this may pick either (fp32 sums in another
order): reported, not failed (as tests/gpu_worker/engine/test_engine_vs_hf_peft.py)."""


def hf_logits(loaded, adapter_dir: Path, prompt: list[int], forced: list[int]):
    """transformers + peft's logits at each step of a completion fed ``forced`` (the mesh's
    tokens), and the base model's alone: one forward of the prompt and the tokens, whose causal
    logits at each position are those of the step that produced the next token."""
    from peft import PeftModel
    from support.hf_llama import hf_llama

    ids = torch.tensor([prompt + forced[:-1]])
    with torch.no_grad():
        model = PeftModel.from_pretrained(hf_llama(loaded), str(adapter_dir)).eval()
        with_adapter = model(ids).logits[0, len(prompt) - 1 :].float()
        with model.disable_adapter():
            base = model(ids).logits[0, len(prompt) - 1 :].float()
    return with_adapter, base


def near_ties(tokens: list[int], reference) -> list[tuple[int, float]]:
    """(step, gap) of each step where ``tokens`` is not the reference's argmax; fails unless
    every such step is a near tie of the reference's top two."""
    ties = []
    for step, ours in enumerate(tokens):
        theirs = int(reference[step].argmax())
        if ours != theirs:
            top2 = reference[step].topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < NEAR_TIE, (
                f"step {step}: the mesh gave {ours}, transformers + peft {theirs} (gap {gap:.2e})"
            )
            ties.append((step, gap))
    return ties
