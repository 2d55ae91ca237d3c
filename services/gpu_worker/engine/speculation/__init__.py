"""Speculative decoding without a draft model: each request drafts its next tokens from its own
prompt and output (``ngram_index.py``) and, with ``suffix``, from its adapter's recent outputs in
its tenant's namespace (``adapter_output_index.py``, ``adapter_indexes.py``), how many it drafts
adapting to how many were accepted (``draft_budget.py``) within a step's row cap
(``speculator.py``); the engine verifies them in its batched step (``verification.py``)."""
