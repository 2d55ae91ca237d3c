"""Speculative decoding without a draft model: each request drafts its next tokens from its own
prompt and output (``ngram_index.py``), how many it drafts adapting to how many were accepted
(``draft_budget.py``); the engine verifies them in its batched step (``verification.py``)."""
