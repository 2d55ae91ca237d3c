"""Iteration-level continuous batching over the unified pool (Orca + S-LoRA)."""
