"""Where an activated LoRA (aLoRA) starts to apply in a request, as PEFT decides it.

An aLoRA adapter (PEFT's ``LoraConfig(alora_invocation_tokens=...)``) changes the model only from
an invocation sequence on: every position before the start of that sequence's last occurrence
in the prompt is the base model's, so its KV is the base model's too. PEFT
(``peft.tuners.lora.variants.calculate_alora_offsets``) finds the invocation once, in the
prompt ``generate`` is given, and keeps it for every generated token; a prompt without it runs
as the base model throughout, its generated tokens included. Tokens generated later never move
the activation, so a request resumed elsewhere as prompt + tokens so far looks for it in its
original prompt only.
"""

from __future__ import annotations

from collections.abc import Sequence


def activation_start(prompt_ids: Sequence[int], invocation_tokens: Sequence[int] | None) -> int | None:
    """The first position the adapter's weights apply to: 0 for a standard LoRA
    (``invocation_tokens`` None), the start of the last occurrence of ``invocation_tokens`` in
    ``prompt_ids`` for an aLoRA, None when the prompt does not hold them (never applied)."""
    if invocation_tokens is None:
        return 0
    invocation = tuple(invocation_tokens)
    width = len(invocation)
    first = invocation[0]
    prompt = tuple(prompt_ids)
    for start in range(len(prompt) - width, -1, -1):
        if prompt[start] == first and prompt[start : start + width] == invocation:
            return start
    return None
