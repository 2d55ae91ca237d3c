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

# One implementation, shared with the gateway, which names a request's prefix blocks for placement.
from services.runtime.prefix_keys import activation_start

__all__ = ["activation_start"]
