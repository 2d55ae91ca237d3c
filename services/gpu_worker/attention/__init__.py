"""Attention over pool pages, written once: the pool's layout and buffer view, micro-attention
over KV blocks and its scale-reduce (DistAttention), used by the model, the rManager and the
lending lanes alike."""
