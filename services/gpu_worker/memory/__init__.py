"""The unified paged pool (S-LoRA §5.1): KV cache pages and LoRA weight pages from one allocator."""
