"""LoRA adapters on the worker: parsed on the host, paged into the unified pool."""
